"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention whose per-head state matrix is
updated by the gated delta rule, beside the models' full-attention layers.

Per token: ``in_proj`` gives q, k, v, the output gate z and the rates b, a; q/k/v go through a
causal conv1d (SiLU); each value head's state ``S`` (Dk x Dv) decays by ``exp(g)``, with
``g = -exp(A_log) * softplus(a + dt_bias)``, and moves toward v along k at rate
``sigmoid(b)``; the output ``S^T q / sqrt(Dk)`` is normed per head, gated by SiLU(z) and
projected out. A request keeps the conv window and ``S`` (float32) in its state slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.state import Conv1dWeight, GatedRMSNorm, StateMixer


class GatedDeltaNet(StateMixer):
    """``in_shards``: the output sizes of the checkpoint tensors stacked into ``in_proj``, whose
    rows are q, k, v, z, b, a once loaded; default: qkv, z, b and a apart (Qwen3.5's).
    ``beta_scale``: multiplies ``sigmoid(b)``; 2 lets the state's eigenvalues go negative
    (OLMo hybrid's ``linear_allow_neg_eigval``)."""

    kind = "gated_delta"

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        in_shards: list[int] | None = None,
        beta_scale: float = 1.0,
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not group over {num_k_heads} key heads")
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.beta_scale = beta_scale
        key, value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.sizes = [2 * key + value, value, num_v_heads, num_v_heads]  # qkv, z, b, a
        self.qkv_sizes = [key, key, value]
        self.in_proj = Linear(hidden, in_shards or [*self.sizes])
        self.conv1d = Conv1dWeight(2 * key + value, conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(value, hidden)

    def state_specs(self) -> tuple[StateSpec, ...]:
        recurrent = StateSpec("recurrent", (self.nv, self.dk, self.dv), float32=True)
        return (self.conv1d.spec(), recurrent)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        n = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        conv = self.conv1d
        qkv = state_ops.call_conv(self, step, qkv, conv.taps(), conv.bias, "silu")
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q, k = q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk)
        if self.nv != self.nk:  # NOTE: each q/k head serves nv // nk consecutive value heads
            q = q.repeat_interleave(self.nv // self.nk, dim=1)
            k = k.repeat_interleave(self.nv // self.nk, dim=1)
        beta = b.sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        v = v.reshape(n, self.nv, self.dv)
        o = state_ops.call_gated_delta(self, step, q, k, v, g, beta, self.dk**-0.5)
        o = self.norm(o, z.reshape(n, self.nv, self.dv))
        return self.out_proj(o.reshape(n, self.nv * self.dv))
