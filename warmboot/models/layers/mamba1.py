"""Mamba 1's selective state space mixer (Mamba, FalconMamba, Jamba).

Per token: ``in_proj`` gives x and the gate z (d_inner each); x goes through a causal conv1d
(SiLU); ``x_proj`` of the convolved x gives the time step's low-rank input (``dt_rank``), B
and C (``d_state`` each); ``dt = softplus(dt_proj(...))`` per channel and ``A = -exp(A_log)``
per (channel, state) drive the selective scan over the state ``h`` (d_inner x d_state,
``kernels.state_ops.selective_scan``), ``y = h C + D x``; then ``y * silu(z)`` and
``out_proj``. A request keeps the conv window and ``h`` (float32) in its state slot.

Variations: Jamba RMS-normalises dt's input, B and C with learned weights; FalconMamba does
the same without weights (``bcdt_norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.state import Conv1dWeight, StateMixer

BCDT_NORMS = (None, "weighted", "weightless")
"""How dt's input, B and C are normalised: not (Mamba), RMSNorm with weights (Jamba's
``dt_layernorm``, ``b_layernorm``, ``c_layernorm``), RMSNorm without (FalconMamba)."""


class WeightlessRMSNorm(nn.Module):
    """``x / rms(x)`` over the last dim, in float32, cast back (FalconMamba's B/C/dt norm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Mamba1Mixer(StateMixer):
    kind = "mamba1"

    def __init__(
        self,
        hidden: int,
        *,
        inner: int,
        d_state: int,
        dt_rank: int,
        conv_kernel: int,
        conv_bias: bool = True,
        proj_bias: bool = False,
        bcdt_norm: str | None = None,
        eps: float = 1e-6,
    ):
        super().__init__()
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"unknown B/C/dt norm {bcdt_norm!r}")
        self.inner, self.d_state, self.dt_rank = inner, d_state, dt_rank
        self.in_proj = Linear(hidden, 2 * inner, bias=proj_bias)
        self.conv1d = Conv1dWeight(inner, conv_kernel, bias=conv_bias)
        self.x_proj = Linear(inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = Linear(dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, d_state))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = Linear(inner, hidden, bias=proj_bias)
        self.bcdt_norm = bcdt_norm
        if bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(dt_rank, eps)
            self.b_layernorm = RMSNorm(d_state, eps)
            self.c_layernorm = RMSNorm(d_state, eps)
        elif bcdt_norm == "weightless":
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = WeightlessRMSNorm(eps)

    def state_specs(self) -> tuple[StateSpec, ...]:
        shape = (self.inner, self.d_state)
        return (self.conv1d.spec(), StateSpec("recurrent", shape, float32=True))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        dtype = x.dtype
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        conv = self.conv1d
        xs = state_ops.call_conv(self, step, xs, conv.taps(), conv.bias, "silu")
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.bcdt_norm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.softplus(self.dt_proj(dt).float())
        A = -torch.exp(self.A_log.float())
        y = state_ops.call_selective_scan(self, step, xs, dt, A, B, C, self.D)
        return self.out_proj((y * F.silu(z)).to(dtype))
