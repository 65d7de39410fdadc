"""Normalisations, each computed as its transformers reference does (upcast order included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, cast back, then scaled by ``weight``.
    ``shape`` may be (H, D): one weight row per head, normalised over the last dim."""

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by ``1 + weight`` in float32, then cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, with or without a bias. ``upcast``: computed in float32
    (Cohere), else in the input's dtype (``nn.LayerNorm``). ``shape`` may be (H, D)."""

    def __init__(
        self, shape: int | tuple[int, ...], eps: float, bias: bool = True, upcast: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(shape)) if bias else None
        self.eps, self.upcast = eps, upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        if self.weight.dim() == 1 and not self.upcast:
            return F.layer_norm(x, (dim,), self.weight, self.bias, self.eps)
        xf = x.float() if self.upcast else x
        out = F.layer_norm(xf, (dim,), None, None, self.eps) * self.weight.to(xf.dtype)
        if self.bias is not None:
            out = out + self.bias.to(xf.dtype)
        return out.to(x.dtype)
