"""Kolibri 1 (Aleph Alpha): GLM-4's sandwich norms (a norm before and after each sublayer)
around EXAONE 4's attention (per-head q/k RMSNorm, windows on the ``sliding_attention``
layers, default every fifth layer full; the full layers NoPE when the config has a window)
and a sparse MoE block on every layer: a float32 router choosing the top-k of the *logits*
plus ``e_score_correction_bias``, weighted by the chosen logits' sigmoids (renormalised with
``norm_topk_prob``), and an ungated shared MLP (``shared_experts``) added unscaled."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.glm4 import Glm4DecoderLayer
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM


class LogitBiasRouter(Router):
    """Top-k of ``logits + e_score_correction_bias``; weights ``sigmoid(logits)`` of the k."""

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = (logits + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = logits.gather(1, ids).sigmoid()
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class Kolibri1ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    renames = (
        *LlamaForCausalLM.renames,
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.moe\.router\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.post_attn_norm\.", ".post_self_attn_layernorm."),
        (r"\.post_ffn_norm\.", ".post_mlp_layernorm."),
    )
    """The release's names (``moe.router.expert_bias``, ``post_attn_norm``, ``post_ffn_norm``)
    and transformers' own."""

    def make_layer(self, index: int) -> nn.Module:
        norms = [self.make_norm(self.cfg.hidden_size) for _ in range(4)]
        nope = self.window() is not None and not self.is_sliding(index)
        options = self.attention_options() | (dict(rope=None) if nope else {})
        return Glm4DecoderLayer(self.attention(index, **options), self.make_mlp(index), *norms)

    def attention_options(self) -> dict:
        return super().attention_options() | dict(qkv_bias=False, o_bias=False)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        size = cfg.get("moe_intermediate_size")
        gate = LogitBiasRouter(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            correction_bias=True,
            float32=True,
        )
        shared = GatedMLP(hidden, cfg.get("shared_expert_intermediate_size"), act)
        return SparseMoE(gate, FusedExperts(experts, hidden, size, act), shared)

    def is_sliding(self, index: int) -> bool:
        types = self.cfg.get("layer_types")
        return (index + 1) % 5 != 0 if types is None else types[index] == "sliding_attention"

    def window(self) -> int | None:
        return self.cfg.hf.get("sliding_window", 513)

    def sliding_window(self, index: int) -> int | None:
        return self.window() if self.is_sliding(index) else None
