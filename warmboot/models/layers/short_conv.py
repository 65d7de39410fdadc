"""LFM2's short convolution: a gated depthwise causal conv1d in the place of attention.

Per token: ``in_proj`` gives B, C and x (each ``hidden`` wide); the conv (no activation) runs
over ``B * x`` and its output is gated by C before ``out_proj``. A request keeps the conv's
last ``K - 1`` inputs in its state slot.
"""

from __future__ import annotations

import torch

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.state import Conv1dWeight, StateMixer


class ShortConv(StateMixer):
    """``bias``: on in_proj, the conv and out_proj alike (LFM2's ``conv_bias``)."""

    kind = "short_conv"

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden = hidden
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv = Conv1dWeight(hidden, kernel, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (self.conv.spec(),)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        conv = self.conv
        y = state_ops.call_conv(self, step, b * h, conv.taps(), conv.bias, None)
        return self.out_proj(c * y)
