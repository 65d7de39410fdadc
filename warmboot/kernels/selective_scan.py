"""Mamba 1's selective scan (Mamba, Jamba, FalconMamba): per channel ``d`` of the inner width
and state index ``n``, with dt already ``softplus(dt_proj(...))`` and ``A = -exp(A_log)``:

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]
    y_t[d]    = sum_n h_t[d, n] C_t[n] + D[d] x_t[d]

Unlike Mamba 2's scalar decay per head, the decay differs per (channel, state) pair, so the
chunked matrix form (SSD) does not apply; the prefill form is a parallel (Hillis-Steele) scan
over chunks of ``chunk_size`` tokens: ``log2(chunk_size)`` elementwise passes over a chunk's
(T, d_inner, d_state) decays and inputs, the state carried from chunk to chunk. Only products
of decays in (0, 1] are formed, so it is as stable as the token loop and agrees with a float64
one to float32 rounding (``tests/test_selective_scan.py``); a cumulative-sum form would divide
by cumulative decays, which leave float32's range (e^-88) within a chunk of a fast channel.
The decode form advances a batch of sequences by one token each, their states in place.

As transformers 5.23's torch path (``mamba_selective_scan`` / ``mamba_selective_state_update``
in ``modeling_mamba``): the decays and inputs in float32, ``dt B`` before ``x``; the state
``(d_inner, d_state)`` is float32 and y is returned in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNKS = {"cpu": 8}
"""Tokens per scan chunk by device type, else ``CHUNK``: the scan's working tensors are
(chunk, d_inner, d_state) float32, ``log2(chunk)`` passes over them. Short chunks keep a CPU's
passes in its caches; long ones keep an accelerator's kernel launches few."""
CHUNK = 64


def _inclusive_scan(a: Tensor, b: Tensor) -> Tensor:
    """``h_t = a_t h_{t-1} + b_t`` from ``h_{-1} = 0`` along dim 0 for every t, in place of
    ``b`` (``a`` is overwritten), in ``ceil(log2 T)`` passes: after the pass with offset ``k``
    each position holds the composition of the ``2k`` steps ending there (``a``: their decay,
    ``b``: their sum)."""
    n, offset = a.shape[0], 1
    while offset < n:
        b[offset:] += a[offset:] * b[:-offset]
        if 2 * offset < n:  # NOTE: the last pass needs no decays after it
            a[offset:] *= a[:-offset].clone()
        offset *= 2
    return b


def selective_scan_chunk(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    state: Tensor,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One sequence from ``state``: x, dt (L, d_inner); A (d_inner, d_state) negative;
    B, C (L, d_state); D (d_inner,); state (d_inner, d_state) float32 (zeros for a fresh
    sequence); ``chunk_size``: tokens per scan chunk (default by device, ``CHUNKS``). Returns
    y (L, d_inner) in x's dtype and the final state (float32, a new tensor)."""
    f32 = torch.float32
    chunk_size = chunk_size or CHUNKS.get(x.device.type, CHUNK)
    x32, dt32, A32 = x.to(f32), dt.to(f32), A.to(f32)
    B32, C32 = B.to(f32), C.to(f32)
    h = state.to(f32, copy=True)
    ys = []
    for start in range(0, x.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        decay = torch.exp(dt32[rows, :, None] * A32)  # (T, d_inner, d_state)
        inputs = (dt32[rows, :, None] * B32[rows, None, :]) * x32[rows, :, None]
        inputs[0].addcmul_(decay[0], h)  # the carried state enters through the first token
        hs = _inclusive_scan(decay, inputs)  # (T, d_inner, d_state): h_t of every token
        ys.append((hs @ C32[rows, :, None])[..., 0])  # (T, d_inner)
        h = hs[-1]
    y = torch.cat(ys) if ys else x32.new_empty(0, x.shape[1])
    return (y + x32 * D.to(f32)).to(x.dtype), h.contiguous()


def selective_scan_step(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, states: Tensor
) -> Tensor:
    """One token for each of N sequences: x, dt (N, d_inner); A (d_inner, d_state);
    B, C (N, d_state); D (d_inner,); states (N, d_inner, d_state) float32, updated in place.
    Returns y (N, d_inner) in x's dtype."""
    f32 = torch.float32
    x32, dt32 = x.to(f32), dt.to(f32)
    states.mul_(torch.exp(dt32[..., None] * A.to(f32)))
    states.addcmul_(dt32[..., None] * B.to(f32)[:, None, :], x32[..., None])
    y = (states @ C.to(f32)[..., None])[..., 0]  # (N, d_inner)
    return (y + x32 * D.to(f32)).to(x.dtype)
