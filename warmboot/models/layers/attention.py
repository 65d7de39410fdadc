"""Self-attention over the paged KV cache: projections, q/k norms, rotary embedding, and
the per-layer attention facts (scale, window, soft-cap) the step's backend applies."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.rope import RotaryEmbedding

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""The step's attention: (q, k, v) of the running layer -> output; it writes the new K/V
into the layer's cache (``kernels.step_ops.StepContext``)."""


class Attention(nn.Module):
    """q/k/v as one stacked projection, optional q/k norms (per head, or over the whole
    projection with ``norm_before_split``), rope (None: a NoPE layer), attention, o_proj;
    ``sinks``: a learned per-head logit in the softmax denominator (GPT-OSS); ``output_gate``:
    the q projection gives each head its query, then as many gate values, and the output is
    multiplied by their sigmoid before o_proj (Qwen3-Next, Qwen3.5); ``head_gate``: a separate
    bias-free ``g_proj`` gives one gate per head, each head's output multiplied by its sigmoid
    (LFM3)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope: RotaryEmbedding | None,
        spec: AttentionSpec,
        qkv_bias: bool = False,
        o_bias: bool = False,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        norm_before_split: bool = False,
        sinks: bool = False,
        output_gate: bool = False,
        head_gate: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.output_gate = output_gate
        q_rows = 2 * self.q_size if output_gate else self.q_size
        self.qkv_proj = Linear(hidden, [q_rows, self.kv_size, self.kv_size], bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.g_proj = Linear(hidden, num_heads) if head_gate else None
        self.q_norm, self.k_norm = q_norm, k_norm
        self.norm_before_split = norm_before_split
        self.rope = rope
        self.spec = spec
        if sinks:  # NOTE: per query head; the runner reads it into the spec after loading
            self.sinks = nn.Parameter(torch.empty(num_heads))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n = x.shape[0]
        q_rows = 2 * self.q_size if self.output_gate else self.q_size
        q, k, v = self.qkv_proj(x).split([q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.reshape(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(n, self.q_size), gate.reshape(n, self.q_size)
        if self.q_norm is not None and self.norm_before_split:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_before_split:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(positions, q, k)
        o = attend(q, k, v)
        if self.g_proj is not None:
            heads = o.reshape(n, self.num_heads, self.head_dim)
            o = heads * torch.sigmoid(self.g_proj(x))[..., None]
        o = o.reshape(n, self.q_size)
        return self.o_proj(o if gate is None else o * torch.sigmoid(gate))
