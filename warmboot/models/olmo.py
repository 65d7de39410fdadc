"""OLMo (the first): Llama with weightless LayerNorms (float32, eps 1e-5) and, optionally,
q/k/v clamped to ``[-clip_qkv, clip_qkv]`` right after their projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.linear import Linear
from warmboot.models.llama import LlamaForCausalLM


class WeightlessLayerNorm(nn.Module):
    """LayerNorm without weight or bias, computed in float32 (eps 1e-5, fixed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, 1e-5).to(x.dtype)


class ClippedLinear(Linear):
    """A ``Linear`` whose output is clamped to ``[-clip, clip]``."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool, clip: float):
        super().__init__(in_features, out_features, bias=bias)
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp(-self.clip, self.clip)


class OlmoForCausalLM(LlamaForCausalLM):
    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return WeightlessLayerNorm()

    def make_layer(self, index: int) -> nn.Module:
        layer = super().make_layer(index)
        clip = self.cfg.get("clip_qkv")
        if clip is not None:
            attn = layer.self_attn
            bias = attn.qkv_proj.bias is not None
            qkv = ClippedLinear(self.cfg.hidden_size, list(attn.qkv_proj.shards), bias, clip)
            attn.qkv_proj = qkv
        return layer

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )
