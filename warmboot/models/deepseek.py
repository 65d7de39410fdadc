"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (``layers.mla``: a latent KV cache
of ``kv_lora_rank + qk_rope_head_dim`` per token and layer) over pre-norm blocks whose MLP is
dense for the first ``first_k_dense_replace`` layers and a sparse MoE after them: routed
experts plus ``n_shared_experts`` always-on experts (one gated MLP of
``moe_intermediate_size * n_shared_experts``, added unscaled).

Routing, in float32 (``layers.moe.Router``):
- V2: softmax, top-k ``greedy`` or ``group_limited_greedy`` (groups scored by their best
  expert), weights times ``routed_scaling_factor``, never renormalised (transformers ignores
  ``norm_topk_prob``; DeepSeek's own code honours it, so ``norm_topk_prob: true`` is refused).
- V3: sigmoid, ``e_score_correction_bias`` for the choice, groups scored by their best two,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.

Rope: V2 rotates interleaved pairs (its complex form); V3 too unless ``rope_interleave`` is
false. With yarn and ``mscale_all_dim`` the softmax scale is ``qk_head_dim ** -0.5`` times
``mscale(factor, mscale_all_dim) ** 2``. V3's multi-token-prediction layers (stored after the
last layer) are not read, as in transformers.
"""

from __future__ import annotations

import math
import re

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.mla import MLAttention
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.rope import RotaryEmbedding

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(CausalLM):
    renames = ((r"^model\.", ""), (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."))
    stacked = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    defaults = dict(first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False)
    """transformers' defaults for settings a config.json may omit."""
    scoring = "softmax"

    def __init__(self, cfg: ModelConfig):
        self.check(cfg)
        super().__init__(cfg)

    # -- settings -------------------------------------------------------------------------------
    def setting(self, name: str):
        return self.cfg.get(name, self.defaults.get(name))

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """Refuse what this family does not serve exactly."""
        refuse = _refuser(cfg.architecture)
        cls.check_attention(cfg, refuse)
        if cfg.get("moe_layer_freq", 1) != 1:
            refuse(f"moe_layer_freq {cfg.get('moe_layer_freq')} (only 1)")
        scoring = cfg.get("scoring_func", cls.scoring)
        if scoring != cls.scoring:
            refuse(f"scoring_func {scoring!r} (only {cls.scoring!r})")
        if not cfg.get("n_routed_experts") or not cfg.get("num_experts_per_tok"):
            refuse("config.json lacks n_routed_experts / num_experts_per_tok")
        cls.check_routing(cfg, refuse)

    @classmethod
    def check_attention(cls, cfg: ModelConfig, refuse) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not cfg.get(name):
                refuse(f"config.json lacks {name}")

    @classmethod
    def check_routing(cls, cfg: ModelConfig, refuse) -> None:
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            refuse(f"topk_method {method!r} (greedy, group_limited_greedy)")
        if cfg.get("norm_topk_prob", False):
            refuse("norm_topk_prob: true (transformers ignores it, DeepSeek's code does not)")
        if method == "group_limited_greedy":
            _check_groups(cfg, refuse)

    def router_options(self) -> dict:
        cfg = self.cfg
        if cfg.get("topk_method", "greedy") == "greedy":
            return {}
        return dict(groups=cfg.get("n_group"), topk_groups=cfg.get("topk_group"), group_score="max")

    def rope_interleaved(self) -> bool:
        return True

    # -- composition ----------------------------------------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        size = self.cfg.hidden_size
        return DecoderLayer(
            self.make_attention(index),
            self.make_mlp(index),
            self.make_norm(size),
            self.make_norm(size),
        )

    def make_attention(self, index: int) -> nn.Module:
        cfg = self.cfg
        nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        spec = self.rope_spec(interleaved=self.rope_interleaved())
        return MLAttention(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg.get("kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=cfg.get("v_head_dim"),
            rope=self.latent_rope(spec, rope),
            spec=AttentionSpec(scale=self.softmax_scale(nope + rope)),
            bias=bool(cfg.get("attention_bias", False)),
        )

    def latent_rope(self, spec, dim: int) -> RotaryEmbedding:
        """One rotary embedding of the rope dims, shared by the layers."""
        ropes = self.__dict__.setdefault("_ropes", {})
        if spec not in ropes:
            ropes[spec] = self.rope_class(spec, dim)
        return ropes[spec]

    def softmax_scale(self, qk_head_dim: int) -> float:
        """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2``."""
        params = self.cfg.get("rope_parameters") or self.cfg.get("rope_scaling") or {}
        scale = qk_head_dim**-0.5
        kind = params.get("rope_type", params.get("type", "default"))
        m_all = params.get("mscale_all_dim")
        factor = params.get("factor") or 1.0
        if kind != "default" and m_all and factor > 1:
            scale *= (0.1 * m_all * math.log(factor) + 1.0) ** 2
        return scale

    def dense_mlp(self, index: int) -> bool:
        return index < self.setting("first_k_dense_replace")

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "silu"), bool(cfg.get("mlp_bias", False))
        if self.dense_mlp(index):
            return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias)
        experts, size = cfg.get("n_routed_experts"), cfg.get("moe_intermediate_size")
        shared = cfg.get("n_shared_experts") or 0
        router = Router(
            cfg.hidden_size,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring=self.scoring,
            renormalize=bool(self.setting("norm_topk_prob")),
            scale=float(self.setting("routed_scaling_factor")),
            float32=True,
            **self.router_options(),
        )
        return SparseMoE(
            router,
            FusedExperts(experts, cfg.hidden_size, size, act),
            GatedMLP(cfg.hidden_size, size * shared, act, bias) if shared else None,
        )

    # -- facts and names ------------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        return self.layers[0].self_attn.kv_layout()

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        layer = _LAYER.match(name)
        if layer and int(layer[1]) >= self.cfg.num_layers:
            return None  # NOTE: multi-token-prediction layers, unused in decoding
        return super().map_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    defaults = dict(first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True)
    scoring = "sigmoid"

    @classmethod
    def check_routing(cls, cfg: ModelConfig, refuse) -> None:
        method = cfg.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            refuse(f"topk_method {method!r} (only noaux_tc)")
        _check_groups(cfg, refuse)
        if cfg.get("n_routed_experts") // cfg.get("n_group") < 2:
            refuse("groups of one expert (a group scores its best two)")

    def router_options(self) -> dict:
        cfg = self.cfg
        groups, kept = cfg.get("n_group"), cfg.get("topk_group")
        return dict(correction_bias=True, groups=groups, topk_groups=kept, group_score="top2")

    def rope_interleaved(self) -> bool:
        return bool(self.cfg.get("rope_interleave", True))


def _check_groups(cfg: ModelConfig, refuse) -> None:
    """Group-limited routing needs groups that divide the experts and hold the top-k."""
    experts, groups, kept = cfg.get("n_routed_experts"), cfg.get("n_group"), cfg.get("topk_group")
    if not groups or not kept or experts % groups or not 0 < kept <= groups:
        refuse(f"n_group {groups} / topk_group {kept} for {experts} experts")
    if cfg.get("num_experts_per_tok") > kept * (experts // groups):
        refuse(f"num_experts_per_tok above the {kept} groups' experts")


def _refuser(architecture: str):
    def refuse(reason: str):
        raise UnsupportedModelError(f"{architecture}: unsupported {reason}")

    return refuse
