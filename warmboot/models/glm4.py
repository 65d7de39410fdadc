"""GLM (``glm-4-9b-hf``) and GLM-4 (0414): Llama with q/k/v biases, gate/up fused in the
checkpoint, and rope on the first half of each head (``partial_rotary_factor``) with
interleaved (GPT-J) pairs; GLM-4 adds a norm after attention and one after the MLP (before
each residual add)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM


class Glm4DecoderLayer(DecoderLayer):
    """``x + post_attn_norm(attn(norm(x)))``, then ``x + post_mlp_norm(mlp(norm(x)))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, *norms: nn.Module):
        super().__init__(self_attn, mlp, norms[0], norms[1])
        self.post_self_attn_layernorm, self.post_mlp_layernorm = norms[2], norms[3]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        x = x + self.post_self_attn_layernorm(h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.post_mlp_layernorm(h)


class GlmForCausalLM(LlamaForCausalLM):
    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1.5625e-07))

    def attention_options(self) -> dict:
        return dict(qkv_bias=bool(self.cfg.get("attention_bias", True)), o_bias=False)

    def rope_spec(self, **overrides) -> RopeSpec:
        partial = self.cfg.get("partial_rotary_factor", 0.5)
        defaults = dict(partial_rotary_factor=partial, interleaved=True)
        return super().rope_spec(**(defaults | overrides))


class Glm4ForCausalLM(GlmForCausalLM):
    def make_layer(self, index: int) -> nn.Module:
        norms = [self.make_norm(self.cfg.hidden_size) for _ in range(4)]
        attn = self.attention(index, **self.attention_options())
        return Glm4DecoderLayer(attn, self.make_mlp(index), *norms)
