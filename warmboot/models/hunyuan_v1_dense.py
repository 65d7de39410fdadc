"""Hunyuan dense (V1): Llama with per-head q/k RMSNorms applied *after* the rope, and the
"dynamic" rope with a fixed NTK ``alpha`` (a static, stretched base).

Hunyuan MoE (V1) replaces every MLP with a sparse block: a float32 router (``gate.wg``:
softmax, top ``moe_topk`` (one per layer when a list), renormalised), ``num_experts``
experts of ``intermediate_size`` and an ungated shared MLP of the same size
(``shared_mlp``), added unscaled."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding
from warmboot.models.llama import LlamaForCausalLM


class RopeThenNorm(nn.Module):
    """Rotates q and k, then normalises them per head (stands in for the attention's rope)."""

    def __init__(self, rope: RotaryEmbedding, query_layernorm: nn.Module, key_layernorm: nn.Module):
        super().__init__()
        self.rope = rope
        self.query_layernorm, self.key_layernorm = query_layernorm, key_layernorm

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rope(positions, q, k)
        return self.query_layernorm(q), self.key_layernorm(k)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    renames = (
        *LlamaForCausalLM.renames,
        (r"\.self_attn\.(query|key)_layernorm\.", r".self_attn.rope.\1_layernorm."),
    )

    def attention_options(self) -> dict:
        d = self.cfg.head_dim
        rope = self.shared_rope(self.rope_spec())
        return super().attention_options() | dict(
            rope=RopeThenNorm(rope, self.make_norm(d), self.make_norm(d))
        )

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )

    def rope_spec(self, **overrides) -> RopeSpec:
        spec = super().rope_spec(**overrides)
        alpha = spec.get("alpha")
        if spec.rope_type != "dynamic" or not alpha:
            return spec
        # NOTE: transformers' "ntk_alpha": the default rope on base theta * alpha^(d/(d-2))
        d = self.cfg.head_dim
        return RopeSpec(
            theta=spec.theta * alpha ** (d / (d - 2)),
            max_position_embeddings=spec.max_position_embeddings,
            partial_rotary_factor=spec.partial_rotary_factor,
        )


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    renames = (
        *HunYuanDenseV1ForCausalLM.renames,
        (r"\.mlp\.gate\.wg\.", ".mlp.gate."),
        (r"\.mlp\.shared_mlp\.", ".mlp.shared_expert."),
    )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, top_k = cfg.get("num_experts", 1), cfg.get("moe_topk", 1)
        if not isinstance(experts, int):  # NOTE: transformers' experts cannot be built so
            raise UnsupportedModelError(f"Hunyuan MoE with num_experts per layer {experts}")
        top_k = top_k if isinstance(top_k, int) else top_k[index]
        hidden, size, act = cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act")
        return SparseMoE(
            Router(hidden, experts, top_k, renormalize=True, float32=True),
            FusedExperts(experts, hidden, size, act or "silu"),
            GatedMLP(hidden, size, act or "silu"),
        )
