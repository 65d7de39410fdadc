"""Laguna (Poolside, ``LagunaForCausalLM``): pre-norm layers whose attention has per-head
q/k RMSNorm, its own query-head count per layer (``num_attention_heads_per_layer``; the KV
heads are shared), a rope per layer type (``rope_parameters[layer_type]``: base and partial
rotary), windows on the ``sliding_attention`` layers and a softplus output gate from
``g_proj`` (one per head, or per channel with ``gating: "per-element"``); MLPs per
``mlp_layer_types``, the sparse ones sigmoid-routed on tanh-soft-capped logits
(``moe_router_logit_softcapping``) with a choice-only ``e_score_correction_bias``,
renormalised, times ``moe_routed_scaling_factor``, plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend, Attention
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.rope import RopeSpec


class SoftplusGatedAttention(Attention):
    """Attention whose output is multiplied by ``softplus(out_gate(x))`` before o_proj:
    one value per head (broadcast over its dims) or one per channel."""

    def __init__(self, *args, per_head: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_gate = Linear(args[0], self.num_heads if per_head else self.q_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        gate = F.softplus(self.out_gate(x).float()).to(x.dtype).reshape(n, heads, -1)

        def gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            o = attend(q, k, v)
            return (o.reshape(n, heads, -1) * gate).reshape(o.shape)

        return super().forward(x, positions, gated)


class SoftcappedRouter(Router):
    """A router whose float32 logits are first soft-capped: ``c * tanh(logits / c)``."""

    def __init__(self, *args, softcap: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = Linear.forward(self, x).float()
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        weights, ids = self.select(logits)
        return weights.to(x.dtype), ids


class LagunaForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.self_attn\.g_proj\.", ".self_attn.out_gate."),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.mlp\.experts\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    )

    def __init__(self, cfg: ModelConfig):
        n = cfg.num_layers
        self.heads = cfg.get("num_attention_heads_per_layer") or [cfg.num_heads] * n
        self.mlp_types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        gating = cfg.get("gating", True)
        if cfg.get("moe_apply_router_weight_on_input", False) or gating not in (
            True,
            "per-head",
            "per-element",
        ):
            raise UnsupportedModelError(f"{cfg.architecture}: gating {gating!r} / weights on input")
        if len(self.heads) != n or len(self.mlp_types) != n:
            raise UnsupportedModelError(f"{cfg.architecture}: per-layer lists of the wrong length")
        super().__init__(cfg)

    def make_layer(self, index: int) -> nn.Module:
        size = self.cfg.hidden_size
        return DecoderLayer(
            self.make_attention(index),
            self.make_mlp(index),
            self.make_norm(size),
            self.make_norm(size),
        )

    def make_attention(self, index: int) -> nn.Module:
        cfg, d = self.cfg, self.cfg.head_dim
        kind = (cfg.get("layer_types") or ["full_attention"] * cfg.num_layers)[index]
        params = (cfg.get("rope_parameters") or {}).get(kind) or {}
        rope = RopeSpec.parse(params, max_position_embeddings=cfg.max_position_embeddings)
        bias = bool(cfg.get("attention_bias", False))
        return SoftplusGatedAttention(
            cfg.hidden_size,
            self.heads[index],
            cfg.num_kv_heads,
            d,
            rope=self.shared_rope(rope),
            spec=AttentionSpec(scale=d**-0.5, sliding_window=self.sliding_window(index)),
            qkv_bias=bias,
            o_bias=bias,
            q_norm=self.make_norm(d),
            k_norm=self.make_norm(d),
            per_head=cfg.get("gating", True) in (True, "per-head"),
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        if self.mlp_types[index] == "dense":
            return GatedMLP(hidden, cfg.get("intermediate_size"), act)
        experts, shared = cfg.get("num_experts"), cfg.get("shared_expert_intermediate_size") or 0
        router = SoftcappedRouter(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=True,
            scale=float(cfg.get("moe_routed_scaling_factor", 1.0)),
            correction_bias=True,
            softcap=float(cfg.get("moe_router_logit_softcapping", 0.0)),
        )
        return SparseMoE(
            router,
            FusedExperts(experts, hidden, cfg.get("moe_intermediate_size"), act),
            GatedMLP(hidden, shared, act) if shared else None,
        )
