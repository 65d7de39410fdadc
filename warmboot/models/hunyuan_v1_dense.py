"""Hunyuan dense (V1): Llama with per-head q/k RMSNorms applied *after* the rope, and the
"dynamic" rope with a fixed NTK ``alpha`` (a static, stretched base)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.layers.activation import GatedMLP
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
