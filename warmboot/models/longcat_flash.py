"""LongCat-Flash (Meituan, ``LongcatFlashForCausalLM``): each of its ``num_layers`` decoder
layers runs two pre-norm sublayers, each multi-head latent attention (DeepSeek's, with a
query LoRA always) then a dense gated MLP, and one MoE block as a shortcut: it reads the
first sublayer's post-attention norm output and its result joins the residual after the
second sublayer's MLP.

The engine sees the sublayers as its layers (``SublayerA``, ``SublayerB``; transformers'
``num_hidden_layers``, twice ``num_layers``): attention sublayer ``i`` of layer ``l`` is
engine layer ``2l + i``, with a latent KV cache of its own, and the compiled step numbers
and caches them like any other layers. The shortcut's output rides to ``SublayerB`` beside
the hidden rows (one ``(N, 2 * hidden)`` tensor between the two).

MLA: the query times ``sqrt(hidden / q_lora_rank)`` (a factor of the softmax scale: q.k is
linear in q), the normed latent times ``sqrt(hidden / kv_lora_rank)`` (cached so),
interleaved rope on ``qk_rope_head_dim`` dims, yarn's ``mscale_all_dim`` in the softmax
scale as DeepSeek's.

MoE routing, in float32: softmax over ``n_routed_experts + zero_expert_num`` logits (the
classifier's bias, where stored, unused as in transformers), ``e_score_correction_bias``
added for the choice only, the top ``moe_topk`` weights times ``routed_scaling_factor``,
never renormalised; an id past the routed experts is a zero expert: the token itself times
its weight (``SparseMoE``'s ``zero_experts``). Multi-token-prediction tensors
(``model.mtp``) and the zero experts' gate/up weights transformers allocates are not read.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.deepseek import DeepseekV2ForCausalLM, _refuser
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.mla import MLAttention
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm

_SUBLAYER = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn|input_layernorm|post_attention_layernorm|mlps)\.([01])\."
)
_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(router\.classifier|router|experts)\.")
_MOE_PARTS = {"router.classifier": "moe.gate", "router": "moe.gate", "experts": "moe.experts"}
_EXPERT = re.compile(r"^(\d+)\.")


class ScaledLatentMLA(MLAttention):
    """MLA whose normed latent is scaled (LongCat's ``mla_scale_kv_lora``), and cached so.
    The query's scale (``mla_scale_q_lora``, on all of it) is the softmax scale's factor."""

    def __init__(self, *args, latent_scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.latent_scale = latent_scale

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, k_pe = super().latent(x)
        return c * self.latent_scale, k_pe


class SublayerA(nn.Module):
    """A decoder layer's first half: attention, then the dense MLP beside the shortcut MoE
    on the same normed rows; returns ``[hidden, moe output]`` (N, 2 * hidden)."""

    def __init__(self, self_attn, mlp, moe, input_layernorm, post_attention_layernorm):
        super().__init__()
        self.self_attn, self.mlp, self.moe = self_attn, mlp, moe
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attend)
        h = self.post_attention_layernorm(x)
        return torch.cat([x + self.mlp(h), self.moe(h)], dim=-1)


class SublayerB(nn.Module):
    """A decoder layer's second half: attention and the dense MLP on the hidden rows, then
    the shortcut MoE's output (``SublayerA``'s second half) added."""

    def __init__(self, self_attn, mlp, input_layernorm, post_attention_layernorm):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, xs: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x, shortcut = xs.chunk(2, dim=-1)
        x = x + self.self_attn(self.input_layernorm(x), positions, attend)
        return x + self.mlp(self.post_attention_layernorm(x)) + shortcut


class LongcatFlashForCausalLM(DeepseekV2ForCausalLM):
    defaults = dict(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        head_dim=64,
        ffn_hidden_size=12288,
        expert_ffn_hidden_size=2048,
        moe_topk=12,
        n_routed_experts=512,
        zero_expert_num=256,
        routed_scaling_factor=6.0,
        rms_norm_eps=1e-5,
        rope_theta=10000000.0,
    )
    """transformers' defaults for settings a config.json may omit."""

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        refuse, get = _refuser(cfg.architecture), _getter(cfg, cls.defaults)
        if get("num_key_value_heads") not in (None, cfg.num_heads):
            refuse("num_key_value_heads unlike num_attention_heads (transformers' MLA fails)")
        nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
        if get("qk_head_dim") not in (None, nope + rope):
            refuse(f"qk_head_dim {get('qk_head_dim')} (only qk_nope + qk_rope, {nope + rope})")
        if get("head_dim") != rope:
            refuse(f"head_dim {get('head_dim')} (the rope width: qk_rope_head_dim {rope})")
        if get("partial_rotary_factor") not in (None, 1.0):
            refuse(f"partial_rotary_factor {get('partial_rotary_factor')}")
        if "q_lora_rank" in cfg.hf and not cfg.hf["q_lora_rank"]:
            refuse("q_lora_rank null (LongCat's query is always low-rank)")
        routed, zero = get("n_routed_experts"), get("zero_expert_num") or 0
        if routed < 1 or not 0 < get("moe_topk") <= routed + zero:
            refuse(f"moe_topk {get('moe_topk')} of {routed} experts and {zero} zero experts")

    def setting(self, name: str):
        return _getter(self.cfg, self.defaults)(name)

    # -- composition ----------------------------------------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        size = self.cfg.hidden_size
        act = self.cfg.get("hidden_act", "silu")
        mlp = GatedMLP(size, self.setting("ffn_hidden_size"), act)
        parts = (self.make_attention(index), mlp)
        norms = (self.make_norm(size), self.make_norm(size))
        if index % 2:
            return SublayerB(*parts, *norms)
        return SublayerA(*parts, self.make_moe(), *norms)

    def make_norm(self, size: int) -> nn.Module:
        return RMSNorm(size, self.setting("rms_norm_eps"))

    def make_attention(self, index: int) -> nn.Module:
        cfg, get = self.cfg, self.setting
        nope, rope, rank = get("qk_nope_head_dim"), get("qk_rope_head_dim"), get("kv_lora_rank")
        spec = self.rope_spec(interleaved=True, theta=get("rope_theta"))
        q_scale = (cfg.hidden_size / get("q_lora_rank")) ** 0.5
        return ScaledLatentMLA(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=rank,
            nope_dim=nope,
            rope_dim=rope,
            v_dim=get("v_head_dim"),
            rope=self.latent_rope(spec, rope),
            spec=AttentionSpec(scale=self.softmax_scale(nope + rope) * q_scale),
            bias=bool(cfg.get("attention_bias", False)),
            latent_scale=(cfg.hidden_size / rank) ** 0.5,
        )

    def make_moe(self) -> SparseMoE:
        get, hidden = self.setting, self.cfg.hidden_size
        routed, zero = get("n_routed_experts"), get("zero_expert_num") or 0
        router = Router(
            hidden,
            routed + zero,
            get("moe_topk"),
            scale=float(get("routed_scaling_factor")),
            correction_bias=True,
            float32=True,
        )
        act = self.cfg.get("hidden_act", "silu")
        experts = FusedExperts(routed, hidden, get("expert_ffn_hidden_size"), act)
        return SparseMoE(router, experts, zero_experts=zero)

    # -- checkpoint names -----------------------------------------------------------------------
    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """A sublayer's tensors onto its engine layer; the MoE's onto the first sublayer's."""
        if name.startswith("model.mtp.") or name.endswith(".router.classifier.bias"):
            return None  # NOTE: multi-token-prediction layers; a bias transformers never adds
        sub = _SUBLAYER.match(name)
        if sub:
            part = "mlp" if sub[2] == "mlps" else sub[2]
            name = f"model.layers.{2 * int(sub[1]) + int(sub[3])}.{part}.{name[sub.end() :]}"
        moe = _MOE.match(name)
        if moe:
            rest = name[moe.end() :]
            expert = _EXPERT.match(rest) if moe[2] == "experts" else None
            if expert and int(expert[1]) >= self.setting("n_routed_experts"):
                return None  # NOTE: a zero expert's gate/up, allocated by transformers, unused
            name = f"model.layers.{2 * int(moe[1])}.{_MOE_PARTS[moe[2]]}.{rest}"
        return super().map_name(name)


def _getter(cfg: ModelConfig, defaults: dict):
    def get(name: str):
        return cfg.get(name, defaults.get(name))

    return get
