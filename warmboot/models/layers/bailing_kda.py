"""Ling's (``bailing_hybrid``) linear attention: Kimi Delta Attention (``layers.kda``: the delta
rule with a decay per head and key channel, the ``kda`` op) with full-rank gates.

Per token: q, k, v (H heads of D) through one causal conv1d over the three (SiLU); the forget
gate from a full-rank ``f_proj`` plus ``dt_bias``, per head and key channel, either bounded
(``kda_safe_gate``, the default) ``g = lower_bound * sigmoid(exp(A_log) * f)`` in
(``kda_lower_bound``, 0), or ``g = -exp(A_log) * softplus(f)``; the rate
``beta = sigmoid(b_proj(x))`` per head. The output ``S^T q / sqrt(D)`` is RMS-normed per head,
gated by ``sigmoid(g_proj(x))`` (full rank) and projected out by ``o_proj``. The state slot
keeps the conv window and ``S`` (H x D x D, float32), as Kimi's.

The six projections of x (q, k, v, f, g, b) run as one stacked ``in_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.models.layers.kda import SigmoidGatedRMSNorm
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.state import JoinedConv1dWeight, StateMixer

IN_SHARDS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj")
"""The checkpoint projections stacked into ``in_proj``, in its row order."""


class BailingDeltaAttention(StateMixer):
    kind = "kda"

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        conv_kernel: int,
        eps: float,
        lower_bound: float | None,
    ):
        """``lower_bound``: the bounded gate's floor (``kda_safe_gate``), None for softplus."""
        super().__init__()
        self.num_heads, self.head_dim, self.lower_bound = num_heads, head_dim, lower_bound
        width = num_heads * head_dim
        self.in_proj = Linear(hidden, [width] * 5 + [num_heads])
        self.sizes = [3 * width, width, width, num_heads]  # qkv, f, g, b
        self.conv1d = JoinedConv1dWeight(3 * width, conv_kernel)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = Linear(width, hidden)

    def state_specs(self) -> tuple[StateSpec, ...]:
        h, d = self.num_heads, self.head_dim
        return (self.conv1d.spec(), StateSpec("recurrent", (h, d, d), float32=True))

    def forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """(N, H * D) -> (N, H, D) float32 log decay, <= 0."""
        f = (f.float() + self.dt_bias.float()).view(f.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is None:
            return -rate * F.softplus(f)
        return self.lower_bound * torch.sigmoid(rate * f)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        n, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv, f, gate, b = self.in_proj(x).split(self.sizes, dim=-1)
        qkv = state_ops.call_conv(self, step, qkv, self.conv1d.taps(), None, "silu")
        q, k, v = qkv.view(n, 3, h, d).unbind(1)
        g, beta = self.forget_gate(f), b.sigmoid()
        o = state_ops.call_kda(self, step, q, k, v, g, beta, 1.0 / d**0.5)
        o = self.o_norm(o, gate.view(n, h, d))
        return self.o_proj(o.reshape(n, h * d))

    def extra_repr(self) -> str:
        gate = "softplus" if self.lower_bound is None else f"bounded {self.lower_bound}"
        return f"heads={self.num_heads}, head_dim={self.head_dim}, gate={gate}"
