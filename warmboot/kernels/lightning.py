"""Lightning attention (MiniMax): linear attention whose per-head state decays by a fixed
rate. Per head, with ``a = exp(-slope)``::

    S_t = a * S_{t-1} + k_t v_t^T        o_t = S_t^T q_t   (no softmax, no scale)

``S`` (H, D, D) float32 is the request's state (keys along dim 1, values along dim 2).

Two forms, as in ``recurrent.py``: ``lightning_prefill`` runs one sequence from a saved state
in chunks (inside a chunk a masked, decayed ``q k^T`` product; across chunks the state,
applied with each query's decay since the chunk's start); ``lightning_step`` advances a batch
of sequences by one token each, their states updated in place. Every decay is ``exp`` of a
non-positive number (no division), so strong decays underflow to 0 instead of overflowing.
Computed in float32 whatever the activations' dtype; outputs in v's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64
"""Tokens per chunk of the prefill form (any size gives the same maths)."""


def slopes(heads: int, layer: int, num_layers: int, device=None) -> Tensor:
    """Each head's decay rate in layer ``layer`` of ``num_layers`` (float32, (H,)): a
    geometric series over the heads, ``2 ** (-8 h / H)`` for head ``h = 1..H``, scaled down
    linearly with depth to about 1e-5 in the last layer (MiniMax's ALiBi-like rates)."""
    base = 1 / (2 ** (8 / heads))
    depth = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return base ** torch.arange(1, heads + 1, device=device) * depth


def _decay(slope: Tensor, steps: Tensor) -> Tensor:
    """``exp(-slope * steps)`` per head: (H,) x (...) -> (H, ...)."""
    return torch.exp(-slope.view(-1, *([1] * steps.dim())) * steps)


def lightning_prefill(
    q: Tensor, k: Tensor, v: Tensor, state: Tensor, slope: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """One sequence: q, k, v (L, H, D); state (H, D, D) float32, the state before the first
    token (zeros for a fresh sequence); slope (H,). Returns o (L, H, D) in v's dtype and the
    state after the last token (a new tensor)."""
    L, H = q.shape[:2]
    S = state.to(torch.float32, copy=True)
    if L == 0:
        return v.new_empty(0, H, v.shape[-1]), S
    s = slope.to(torch.float32)
    q, k, v32 = (t.to(torch.float32).transpose(0, 1) for t in (q, k, v))  # (H, L, D)
    c = min(chunk, L)
    t = torch.arange(c, device=q.device, dtype=torch.float32)
    gap = t[:, None] - t[None, :]
    within = torch.where(gap >= 0, _decay(s, gap.clamp(min=0)), 0.0)  # (H, c, c): i <- j
    since_start = _decay(s, t + 1)[..., None]  # (H, c, 1): the state's decay at query i
    to_end = _decay(s, t.flip(0))[..., None]  # (H, c, 1): key j's decay to the chunk's end
    out = torch.empty_like(v32)
    for start in range(0, L, c):
        n = min(c, L - start)
        qc, kc, vc = (x[:, start : start + n] for x in (q, k, v32))
        intra = ((qc @ kc.transpose(1, 2)) * within[:, :n, :n]) @ vc
        out[:, start : start + n] = intra + (qc * since_start[:, :n]) @ S
        S = torch.exp(-s * n)[:, None, None] * S + (kc * to_end[:, c - n :]).transpose(1, 2) @ vc
    return out.transpose(0, 1).to(v.dtype), S


def lightning_step(q: Tensor, k: Tensor, v: Tensor, states: Tensor, slope: Tensor) -> Tensor:
    """One token for each of B sequences: q, k, v (B, H, D); states (B, H, D, D) float32,
    updated in place; slope (H,). Returns o (B, H, D) in v's dtype."""
    states.mul_(torch.exp(-slope.to(torch.float32))[:, None, None])
    k32, v32 = k.to(torch.float32), v.to(torch.float32)
    states.add_(k32[..., :, None] * v32[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q.to(torch.float32), states).to(v.dtype)
