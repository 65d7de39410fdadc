"""ERNIE 4.5 (dense): Llama with ``use_bias`` on every projection, tied embeddings by
default, and the interleaved rope computed in float32 (float32 tables, q/k upcast)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.cohere import CohereRotaryEmbedding
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM


class Float32RotaryEmbedding(CohereRotaryEmbedding):
    """Tables kept in float32 whatever the model's dtype; q and k rotated in float32."""

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().build(max_positions, torch.float32, device)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    tied_by_default = True
    rope_class = Float32RotaryEmbedding

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("use_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "silu"), bool(cfg.get("use_bias", False))
        return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias)

    def rope_spec(self, **overrides) -> RopeSpec:
        return super().rope_spec(**(dict(interleaved=True) | overrides))
