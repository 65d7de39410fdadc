"""Float64 torch references for the Triton attention kernels (tests and benchmarks).

Conventions (flash-attn's): query i of a sequence sits at key position ``k_len - q_len + i``
(bottom-right alignment); key j is visible when ``pos - left <= j <= pos + right`` (-1 means
unbounded; causal sets ``right = 0``). Softcap: ``s = cap * tanh(s / cap)`` on scaled scores.
Fully masked rows give output 0 and log-sum-exp -inf. Sinks: a per-head logit joins each
row's softmax denominator (and the log-sum-exp) without a value. Chunks (Llama 4's chunked
local attention): a query at ``pos`` also sees no key before ``pos - pos % chunk``.
"""

from __future__ import annotations

import torch


def visible(
    q_len: int, k_len: int, window: tuple[int, int], causal: bool, chunk: int | None = None
) -> torch.Tensor:
    """(q_len, k_len) bool mask, bottom-right aligned."""
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(k_len - q_len, k_len).unsqueeze(1)
    j = torch.arange(k_len).unsqueeze(0)
    mask = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        mask &= j >= pos - left
    if right >= 0:
        mask &= j <= pos + right
    if chunk is not None:
        mask &= j >= pos - pos % chunk
    return mask


def _attend(q, k, v, mask, scale, softcap, sinks=None):
    """q (Hq, M, D), k/v (Hkv, N, D) float64, mask (M, N), sinks (Hq,) or None
    -> out (Hq, M, D), lse (Hq, M)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    s = torch.einsum("hmd,hnd->hmn", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hq, M)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double().to(s.device)[:, None])
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    out = torch.einsum("hmn,hnd->hmd", p, v)
    return out, lse


def varlen_attention_ref(
    q: torch.Tensor,  # (total_q, Hq, D)
    k: torch.Tensor,  # (total_k, Hkv, D)
    v: torch.Tensor,  # (total_k, Hkv, D)
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out (total_q, Hq, D), lse (Hq, total_q)) in natural log."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qd, kd, vd = (t.double() for t in (q, k, v))
    out = torch.zeros_like(qd)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        mask = visible(qe - qs, ke - ks, window_size, causal, chunk)
        o, l_ = _attend(
            qd[qs:qe].transpose(0, 1),
            kd[ks:ke].transpose(0, 1),
            vd[ks:ke].transpose(0, 1),
            mask,
            scale,
            softcap,
            sinks,
        )
        out[qs:qe] = o.transpose(0, 1)
        lse[:, qs:qe] = l_
    return out, lse


def paged_decode_ref(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (B, max_blocks)
    seqused_k: torch.Tensor,  # (B,)
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out (B, Hq, D), lse (Hq, B)): one query token at the last position."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for b, n in enumerate(seqused_k.tolist()):
        if n == 0:
            if sinks is not None:  # only the sink in the denominator
                lse[:, b] = sinks.double()
            continue
        blocks = block_table[b, : -(-n // k_cache.shape[1])].long()
        keys = k_cache[blocks].flatten(0, 1)[:n].double().transpose(0, 1)  # (Hkv, n, D)
        vals = v_cache[blocks].flatten(0, 1)[:n].double().transpose(0, 1)
        mask = visible(1, n, window_size, causal=True, chunk=chunk)
        o, l_ = _attend(q[b].double().unsqueeze(1), keys, vals, mask, scale, softcap, sinks)
        out[b] = o[:, 0]
        lse[:, b] = l_[:, 0]
    return out, lse
