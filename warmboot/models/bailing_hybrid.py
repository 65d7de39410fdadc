"""Ling 3.0's hybrid (``bailing_hybrid``, inclusionAI): Kimi-delta-attention state layers
(``layers.bailing_kda``, ``linear_attention``) beside gated multi-head latent attention
(``full_attention``) over pre-norm blocks whose MLP is dense or DeepSeek-V3's MoE.

- Layer kinds: ``layer_types``, else the last layer of every ``layer_group_size`` (default 6)
  attends; MLPs: ``mlp_layer_types``, else dense below ``first_k_dense_replace`` (default 2).
- Linear attention: KDA with full-rank forget and output gates, the forget gate bounded
  (``kda_safe_gate``, ``kda_lower_bound``) or softplus; its heads, head dim and conv kernel
  are ``linear_num_heads`` / ``linear_head_dim`` / ``linear_conv_kernel_dim`` when given, else
  ``num_attention_heads`` / ``head_dim`` / ``short_conv_kernel_size`` (transformers' order).
- Latent attention: DeepSeek's with a full-rank query (``q_lora_rank`` is not read),
  interleaved rope over ``qk_rope_head_dim`` (``rope_interleave`` is not read), and each
  head's output times ``sigmoid(g_proj(x))`` before ``o_proj``.
- MoE: DeepSeek-V3's (sigmoid, correction bias, groups scored by their best two, renormalised,
  scaled, shared experts) under Ling's names (``num_experts``, ``num_experts_per_token``,
  ``num_shared_experts``, ``moe_renormalize``, ``num_expert_group``), with transformers'
  defaults; a config giving one setting two values is refused.
- Checkpoint names: transformers' and the official ones (``word_embeddings``, ``attention``,
  ``dense``, ``q/k/v_conv1d``, ``expert_bias``, per-expert projections); the
  multi-token-prediction layers (after the last layer) are not read, as in transformers.

Refused: fewer KV heads than heads (transformers' attention breaks), activations other than
SiLU (the KDA conv's too), groups that do not divide the experts or hold the top-k.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import torch

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.deepseek import DeepseekV3ForCausalLM, _refuser
from warmboot.models.kimi_linear import FULL, LINEAR, MLP_KINDS, KdaHybrid, renamed_settings
from warmboot.models.layers.bailing_kda import IN_SHARDS, BailingDeltaAttention
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.mla import MLAttention
from warmboot.models.layers.state import QKV_CONVS

SETTINGS: dict[str, tuple[tuple[str, ...], Any]] = {
    # DeepSeek's name: (the names a Ling config may use, transformers' default)
    "n_routed_experts": (("num_experts", "num_local_experts"), 512),
    "num_experts_per_tok": (("num_experts_per_token", "num_experts_per_tok"), 8),
    "n_shared_experts": (("num_shared_experts", "n_shared_experts"), 1),
    "norm_topk_prob": (("moe_renormalize", "norm_topk_prob"), True),
    "n_group": (("num_expert_group", "n_group"), 8),
    "topk_group": (("topk_group",), 4),
    "routed_scaling_factor": (("routed_scaling_factor",), 2.5),
    "first_k_dense_replace": (("first_k_dense_replace",), 2),
    "kv_lora_rank": (("kv_lora_rank",), 512),
    "qk_rope_head_dim": (("qk_rope_head_dim",), 64),
    "qk_nope_head_dim": (("qk_nope_head_dim",), 128),
    "v_head_dim": (("v_head_dim",), 128),
    "moe_intermediate_size": (("moe_intermediate_size",), 768),
    "intermediate_size": (("intermediate_size",), 6144),
    "rms_norm_eps": (("rms_norm_eps",), 1e-6),
    "hidden_act": (("hidden_act",), "silu"),
    "rope_theta": (("rope_theta",), 6_000_000.0),
    "layer_group_size": (("layer_group_size",), 6),
    "kda_safe_gate": (("kda_safe_gate",), True),
    "kda_lower_bound": (("kda_lower_bound",), -5.0),
}
LINEAR_SETTINGS = {
    # ours: (the names that set it, first wins; transformers' default)
    "linear_num_heads": (("linear_num_heads", "num_attention_heads"), 32),
    "linear_head_dim": (("linear_head_dim", "head_dim"), 128),
    "linear_conv_kernel_dim": (("linear_conv_kernel_dim", "short_conv_kernel_size"), 4),
}
FIXED = dict(
    # what transformers' Ling code does whatever a config says (DeepSeek's code reads these)
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    moe_layer_freq=1,
    q_lora_rank=None,
    rope_interleave=True,
    mlp_bias=False,
)


def as_deepseek(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A Ling config under DeepSeek-V3's names, with transformers' defaults, its
    ``layer_types`` and ``mlp_layer_types`` spelled out and the linear-attention sizes."""
    refuse = _refuser("BailingHybridForCausalLM")
    out = renamed_settings(hf, SETTINGS, refuse)
    for ours, (names, default) in LINEAR_SETTINGS.items():
        out[ours] = next((hf[n] for n in names if hf.get(n) is not None), default)
    group, dense = out["layer_group_size"], out["first_k_dense_replace"]
    if not hf.get("layer_types"):
        if not isinstance(group, int) or group < 1:
            refuse(f"layer_group_size {group!r}")
        out["layer_types"] = [FULL if (i + 1) % group == 0 else LINEAR for i in range(num_layers)]
    if not hf.get("mlp_layer_types"):
        out["mlp_layer_types"] = [MLP_KINDS[i >= dense] for i in range(num_layers)]
    # NOTE: every layer's MLP kind is listed: DeepSeek's own count of dense layers is off
    return out | FIXED | dict(first_k_dense_replace=0)


class GatedMLAttention(MLAttention):
    """DeepSeek's latent attention with each head's output times ``sigmoid(g_proj(x))``."""

    def __init__(self, hidden: int, num_heads: int, **kwargs):
        super().__init__(hidden, num_heads, **kwargs)
        self.g_proj = Linear(hidden, num_heads)

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g_proj(x).float()).to(o.dtype)
        return super().project_out(x, o * gate.unsqueeze(-1))


class BailingHybridForCausalLM(KdaHybrid):
    renames = (
        (r"^model\.word_embeddings\.", "model.embed_tokens."),  # NOTE: the official names
        (r"^model\.", ""),
        (r"\.attention\.", ".self_attn."),
        (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        (r"\.self_attn\.forget_gate\.", ".self_attn."),  # NOTE: transformers' module
        (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    )
    in_shards = IN_SHARDS
    stacked = DeepseekV3ForCausalLM.stacked | {c: ("conv1d", i) for i, c in enumerate(QKV_CONVS)}

    def __init__(self, cfg: ModelConfig):
        hf = MappingProxyType(as_deepseek(dict(cfg.hf), cfg.num_layers))
        super().__init__(dataclasses.replace(cfg, hf=hf))

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        refuse = _refuser(cfg.architecture)
        super().check(cfg)
        kv_heads = cfg.hf.get("num_key_value_heads", 32)  # NOTE: transformers' default
        if kv_heads is not None and kv_heads != cfg.num_heads:
            refuse(f"num_key_value_heads {kv_heads} != {cfg.num_heads} heads")
        if not isinstance(cfg.get("kda_lower_bound"), int | float):
            refuse(f"kda_lower_bound {cfg.get('kda_lower_bound')!r}")

    # -- composition ----------------------------------------------------------------------------
    def kda_mixer(self) -> torch.nn.Module:
        cfg = self.cfg
        return BailingDeltaAttention(
            cfg.hidden_size,
            cfg.get("linear_num_heads"),
            cfg.get("linear_head_dim"),
            cfg.get("linear_conv_kernel_dim"),
            cfg.get("rms_norm_eps"),
            float(cfg.get("kda_lower_bound")) if cfg.get("kda_safe_gate") else None,
        )

    def make_attention(self, index: int) -> torch.nn.Module:
        cfg = self.cfg
        nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        return GatedMLAttention(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=None,
            kv_lora_rank=cfg.get("kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=cfg.get("v_head_dim"),
            rope=self.latent_rope(self.rope_spec(interleaved=True), rope),
            spec=AttentionSpec(scale=self.softmax_scale(nope + rope)),
            bias=bool(cfg.get("attention_bias", False)),
        )
