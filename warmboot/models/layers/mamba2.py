"""Mamba 2's selective state space mixer (Mamba 2, Granite 4, Bamba, Nemotron-H, Falcon-H1).

Per token: ``in_proj`` gives the gate z, the conv input xBC and dt per head; xBC goes through a
causal conv1d (SiLU) and splits into x (heads x head_dim), B and C (groups x state); with
``dt = softplus(dt + dt_bias)`` and ``A = -exp(A_log)`` each head's state ``h`` (head_dim x
state) moves as ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x`` (``kernels.state_ops.ssd``);
y is gated by SiLU(z) and normed per group (Mamba 2's gated RMSNorm, the gate first), then
projected out. A request keeps the conv window and ``h`` (float32) in its state slot.

``dt_limit`` clamps dt in prefill rows only, as transformers' (and mamba_ssm's) chunked scan
does while their one-token step does not: rows after the step's decode rows, read from the
step (``warmboot::mamba_dt_limit`` in a compiled step).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.kernels.step_ops import _context
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.state import Conv1dWeight, GatedRMSNorm, StateMixer

NO_LIMIT = (0.0, math.inf)
"""The default ``time_step_limit``: softplus is never below 0, so nothing to clamp."""


class Mamba2Mixer(StateMixer):
    """``norm``: called as ``norm(y, z)``; default Mamba 2's grouped gated RMSNorm (gate
    first); None: ``y * silu(z)`` (Falcon-H1 without ``mamba_rms_norm``). ``in_scale``
    multiplies the input, ``multipliers`` the z, x, B, C and dt parts of ``in_proj``'s output
    (Falcon-H1's ``ssm_in_multiplier`` and ``ssm_multipliers``)."""

    kind = "mamba2"

    def __init__(
        self,
        hidden: int,
        *,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        conv_bias: bool = True,
        in_bias: bool = False,
        out_bias: bool = False,
        dt_limit=NO_LIMIT,
        norm: nn.Module | None | str = "gated",
        in_scale: float | None = None,
        multipliers: list[float] | None = None,
    ):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"{num_heads} SSM heads do not group over {n_groups} groups")
        inner, group = num_heads * head_dim, n_groups * d_state
        self.heads, self.head_dim, self.inner = num_heads, head_dim, inner
        self.groups, self.d_state, self.chunk_size = n_groups, d_state, chunk_size
        self.sizes = [inner, inner + 2 * group, num_heads]  # z, xBC, dt
        self.part_sizes = [inner, inner, group, group, num_heads]  # z, x, B, C, dt
        self.in_proj = Linear(hidden, sum(self.sizes), bias=in_bias)
        self.conv1d = Conv1dWeight(inner + 2 * group, conv_kernel, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        if norm == "gated":
            norm = GatedRMSNorm(inner, eps, group_size=inner // n_groups, gate_first=True)
        self.norm = norm
        self.out_proj = Linear(inner, hidden, bias=out_bias)
        dt_limit = parse_limit(dt_limit)
        self.dt_limit = None if dt_limit == NO_LIMIT else dt_limit
        self.in_scale, self.multipliers = in_scale, multipliers

    def state_specs(self) -> tuple[StateSpec, ...]:
        shape = (self.heads, self.head_dim, self.d_state)
        return (self.conv1d.spec(), StateSpec("recurrent", shape, float32=True))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        n, dtype = x.shape[0], x.dtype
        if self.in_scale is not None:
            x = x * self.in_scale
        zxbcdt = self.in_proj(x)
        if self.multipliers is not None:
            zxbcdt = zxbcdt * self._mup(zxbcdt)
        z, xbc, dt = zxbcdt.split(self.sizes, dim=-1)
        conv = self.conv1d
        xbc = state_ops.call_conv(self, step, xbc, conv.taps(), conv.bias, "silu")
        xs, B, C = xbc.split(self.part_sizes[1:4], dim=-1)
        dt = self._clamp(F.softplus(dt + self.dt_bias.to(dt.dtype)), step)
        A = -torch.exp(self.A_log.float())
        y = state_ops.call_ssd(
            self,
            step,
            xs.reshape(n, self.heads, self.head_dim),
            dt,
            A,
            B.reshape(n, self.groups, self.d_state),
            C.reshape(n, self.groups, self.d_state),
            self.D,
            self.chunk_size,
        ).reshape(n, self.inner)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        return self.out_proj(y.to(dtype))

    def _mup(self, like: torch.Tensor) -> torch.Tensor:
        """The per-channel multipliers of ``in_proj``'s output, as transformers builds them
        (float32, then the activations' dtype)."""
        parts = [
            torch.full((size,), m, dtype=torch.float32, device=like.device)
            for size, m in zip(self.part_sizes, self.multipliers, strict=True)
        ]
        return torch.cat(parts).to(like.dtype)

    def _clamp(self, dt: torch.Tensor, step) -> torch.Tensor:
        if self.dt_limit is None:
            return dt
        lo, hi = self.dt_limit
        if state_ops.layer_index(self) is not None:
            return torch.ops.warmboot.mamba_dt_limit(dt, lo, hi)
        return clamp_prefill_rows(dt, step.meta.num_decode_tokens, lo, hi)


def parse_limit(limit) -> tuple[float, float]:
    """A config's ``time_step_limit`` (None: no limit); transformers saves infinity as
    ``{"__float__": "Infinity"}``."""
    if limit is None:
        return NO_LIMIT
    values = tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
    if len(values) != 2:
        raise ValueError(f"time_step_limit {limit!r} is not a (min, max) pair")
    return values


def clamp_prefill_rows(dt: torch.Tensor, decodes: int, lo: float, hi: float) -> torch.Tensor:
    """``dt`` with the rows from ``decodes`` on clamped to [lo, hi]."""
    if decodes == 0:
        return dt.clamp(lo, hi)
    return torch.cat([dt[:decodes], dt[decodes:].clamp(lo, hi)])


# -- a compiled step's clamp: the decode rows are known only when the step runs ----------------
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define("mamba_dt_limit(Tensor dt, float lo, float hi) -> Tensor")


def _dt_limit_op(dt, lo, hi):
    return clamp_prefill_rows(dt, _context("mamba_dt_limit").meta.num_decode_tokens, lo, hi)


_LIB.impl("mamba_dt_limit", _dt_limit_op, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::mamba_dt_limit")
def _(dt, lo, hi):
    return torch.empty_like(dt)
