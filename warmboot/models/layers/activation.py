"""Activations by their transformers names, and the two MLP shapes (gated and plain)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.models.layers.linear import Linear


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` (transformers' ``relu2``: Jais 2, NanoChat)."""
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_fast": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": relu_squared,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        from warmboot.architectures import UnsupportedModelError

        raise UnsupportedModelError(
            f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up as one stacked projection."""

    fused_silu = False
    """A packed view's (``device.compiled.packed_view``): SiLU and the product in one op with
    the projection (``PackedMethod.gated``)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_silu:
            return self.down_proj(self.gate_up_proj.method.gated(self.gate_up_proj, x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """``down(act(up(x)))`` (GPT-NeoX, StarCoder2)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = True):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
