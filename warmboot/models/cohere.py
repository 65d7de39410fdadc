"""Cohere (Command R) and Cohere 2 (Command R7B, A): parallel blocks
``x + attn(ln(x)) + mlp(ln(x))`` with one bias-free LayerNorm computed in float32, the
interleaved (GPT-J) rope applied in float32, logits times ``logit_scale``, tied embeddings
by default. Cohere: optional per-head (H, D) q/k LayerNorms. Cohere 2: windows on the
``sliding_attention`` layers, which alone are rotated (the full-attention layers are NoPE)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.config import ModelConfig
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding


class CohereRotaryEmbedding(RotaryEmbedding):
    """q and k rotated in float32 by the table (in the model's dtype), then cast back."""

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qf, kf = super().forward(positions, q.float(), k.float())
        return qf.to(q.dtype), kf.to(k.dtype)


class ParallelDecoderLayer(nn.Module):
    """``x + attn(ln(x)) + mlp(ln(x))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = input_layernorm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, positions, attend) + self.mlp(h)


class CohereForCausalLM(CausalLM):
    tied_by_default = True
    rope_class = CohereRotaryEmbedding

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.logit_scale = float(cfg.hf.get("logit_scale", 0.0625))

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("layer_norm_eps", 1e-5), bias=False, upcast=True)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        return ParallelDecoderLayer(
            self.attention(index, **self.attention_options(index)),
            GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")),
            self.make_norm(cfg.hidden_size),
        )

    def attention_options(self, index: int) -> dict:
        cfg, bias = self.cfg, bool(self.cfg.get("attention_bias", False))
        options = dict(qkv_bias=bias, o_bias=bias)
        if cfg.get("use_qk_norm", False):
            q_norm = self.make_norm((cfg.num_heads, cfg.head_dim))
            options.update(q_norm=q_norm, k_norm=self.make_norm((cfg.num_kv_heads, cfg.head_dim)))
        return options

    def rope_spec(self, **overrides) -> RopeSpec:
        return super().rope_spec(**(dict(interleaved=True) | overrides))


class Cohere2ForCausalLM(CohereForCausalLM):
    def attention_options(self, index: int) -> dict:
        bias = bool(self.cfg.get("attention_bias", False))
        options = dict(qkv_bias=bias, o_bias=bias)
        # NOTE: transformers rotates only the layers with a window (no window: no rope at all).
        return options if self.sliding_window(index) is not None else options | dict(rope=None)

    def sliding_window(self, index: int) -> int | None:
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is None:  # NOTE: transformers' default from the older sliding_window_pattern
            sliding = (index + 1) % cfg.hf.get("sliding_window_pattern", 4) != 0
        else:
            sliding = types[index] == "sliding_attention"
        return cfg.hf.get("sliding_window", 4096) if sliding else None
