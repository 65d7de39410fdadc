"""Phi (phi-1, phi-1.5, phi-2): one LayerNorm feeding attention and a plain MLP in parallel,
``x + attn(ln(x)) + mlp(ln(x))``; biases everywhere (the LM head's too), partial rotary,
optional per-head q/k LayerNorms."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.base import STACKED, CausalLM
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RopeSpec


class ParallelLayer(nn.Module):
    """Attention and MLP on the same normed input: ``attn + mlp + x``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = self_attn, mlp, input_layernorm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.input_layernorm(x)
        return self.self_attn(h, positions, attend) + self.mlp(h) + x


class PhiForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^final_layernorm\.", "norm."),
        (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        (r"\.self_attn\.([qk])_layernorm\.", r".self_attn.\1_norm."),
        (r"\.mlp\.fc1\.", ".mlp.up_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
    )
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """q/k/v stacked; ``up_proj`` (``fc1``) is the plain MLP's, not a gate/up shard."""

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        norms = {}
        if cfg.get("qk_layernorm", False):
            norms = dict(q_norm=self.make_norm(cfg.head_dim), k_norm=self.make_norm(cfg.head_dim))
        attn = self.attention(index, qkv_bias=True, o_bias=True, **norms)
        mlp = MLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "gelu_new"))
        return ParallelLayer(attn, mlp, self.make_norm(cfg.hidden_size))

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("layer_norm_eps", 1e-5))

    def head_bias(self) -> bool:
        return True

    def rope_spec(self, **overrides) -> RopeSpec:
        partial = self.cfg.get("partial_rotary_factor", 0.5)
        return super().rope_spec(**(dict(partial_rotary_factor=partial) | overrides))
