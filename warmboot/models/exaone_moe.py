"""K-EXAONE (``ExaoneMoeForCausalLM``): EXAONE 4's attention (per-head q/k RMSNorm, windowed
layers rotated, the global layers NoPE when the config has a window) in pre-norm layers
(EXAONE 4's are post-norm) whose MLP is DeepSeek-V3's MoE block where ``mlp_layer_types``
says "sparse": sigmoid routing in float32 with ``e_score_correction_bias``, groups scored by
their best two, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``, plus
``num_shared_experts`` always-on experts. Its multi-token-prediction tensors are not read."""

from __future__ import annotations

from torch import nn

from warmboot.config import ModelConfig
from warmboot.models.deepseek import _check_groups, _refuser
from warmboot.models.exaone4 import Exaone4ForCausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE


class ExaoneMoeForCausalLM(Exaone4ForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),  # NOTE: saved
    )
    ignored = (r"rotary_emb\.inv_freq$", r"^mtp\.")

    def __init__(self, cfg: ModelConfig):
        n, first = cfg.num_layers, cfg.get("first_k_dense_replace", 1)
        self.mlp_types = cfg.get("mlp_layer_types") or [
            "dense" if i < first else "sparse" for i in range(n)
        ]
        refuse = _refuser(cfg.architecture)
        if len(self.mlp_types) != n or set(self.mlp_types) - {"dense", "sparse"}:
            refuse(f"mlp_layer_types {self.mlp_types}")
        _check_groups(cfg.hf | dict(n_routed_experts=cfg.get("num_experts")), refuse)
        super().__init__(cfg)

    def make_layer(self, index: int) -> nn.Module:
        post = super().make_layer(index)  # NOTE: EXAONE 4's attention, q/k norms, NoPE globals
        size = self.cfg.hidden_size
        return DecoderLayer(
            post.self_attn, self.make_mlp(index), self.make_norm(size), self.make_norm(size)
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        if self.mlp_types[index] == "dense":
            return GatedMLP(hidden, cfg.get("intermediate_size"), act)
        experts, size = cfg.get("num_experts"), cfg.get("moe_intermediate_size")
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scale=float(cfg.get("routed_scaling_factor", 2.5)),
            correction_bias=True,
            groups=cfg.get("n_group", 1),
            topk_groups=cfg.get("topk_group", 1),
            float32=True,
        )
        shared = cfg.get("num_shared_experts", 1) or 0
        return SparseMoE(
            router,
            FusedExperts(experts, hidden, size, act),
            GatedMLP(hidden, size * shared, act) if shared else None,
        )
