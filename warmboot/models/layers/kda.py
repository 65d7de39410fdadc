"""Kimi Delta Attention (KDA, Kimi Linear): the gated delta rule with a forget gate per key
channel rather than per head, beside the model's latent-attention layers.

Per token: q, k, v (H heads of D), each through a causal conv1d (SiLU); a low-rank forget
gate ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` per head and key channel; the rate
``beta = sigmoid(b(x))`` per head. Each head's state ``S`` (D x D) decays row by row by
``exp(g)`` and moves toward v along k at rate beta (``kernels.recurrent.chunk_kda``); the
output ``S^T q / sqrt(D)`` is RMS-normed per head, gated by ``sigmoid(g_b(g_a(x)))`` and
projected out. A request keeps the conv window and ``S`` (float32) in its state slot.

The six projections of x (q, k, v, f_a, g_a, b) run as one stacked ``in_proj``; the three
convs as one (checkpoints store ``q_conv1d``/``k_conv1d``/``v_conv1d`` or transformers'
concatenated ``conv1d``).
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.state import JoinedConv1dWeight, StateMixer

IN_SHARDS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
"""The checkpoint projections stacked into ``in_proj``, in its row order."""


class SigmoidGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * sigmoid(gate)`` over the last dim, all in float32, cast back to
    x's dtype at the end (transformers' ``KimiLinearRMSNormGated``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(StateMixer):
    kind = "kda"

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.in_proj = Linear(hidden, [width, width, width, head_dim, head_dim, num_heads])
        self.sizes = [3 * width, head_dim, head_dim, num_heads]  # qkv, f_a, g_a, b
        self.conv1d = JoinedConv1dWeight(3 * width, conv_kernel)
        self.f_b_proj = Linear(head_dim, width)
        self.g_b_proj = Linear(head_dim, width)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = Linear(width, hidden)

    def state_specs(self) -> tuple[StateSpec, ...]:
        h, d = self.num_heads, self.head_dim
        return (self.conv1d.spec(), StateSpec("recurrent", (h, d, d), float32=True))

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """(N, D) low-rank input -> (N, H, D) float32 log decay, <= 0. Softplus as
        ``log(1 + exp(f))`` below 20, ``f`` above (transformers' form, kept for its rounding)."""
        f = self.f_b_proj(f_a).float() + self.dt_bias.float()
        f = f.view(f.shape[0], self.num_heads, self.head_dim)
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        return -self.A_log.float().exp()[:, None] * softplus

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        n, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv, f_a, g_a, b = self.in_proj(x).split(self.sizes, dim=-1)
        conv = self.conv1d
        qkv = state_ops.call_conv(self, step, qkv, conv.taps(), None, "silu")
        q, k, v = qkv.view(n, 3, h, d).unbind(1)
        g, beta = self.forget_gate(f_a), b.sigmoid()
        o = state_ops.call_kda(self, step, q, k, v, g, beta, 1.0 / d**0.5)
        o = self.o_norm(o, self.g_b_proj(g_a).view(n, h, d))
        return self.o_proj(o.reshape(n, h * d))
