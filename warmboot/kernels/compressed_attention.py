"""DeepSeek-V4's attention: one K = V head over a sliding window and attention sinks, beside
K/V compressed every ``rate`` tokens (CSA: overlapping windows, a lightning indexer picking
``topk`` entries per query; HCA: every entry).

The paged cache: per token and layer its rotated K (= V) (one ``KVLayout`` entry, one head),
and in the index pages (``KVLayout.index_dim``) the compressor's inputs of the token: its
projections ``kv | gate`` (CSA: two series each, then the indexer compressor's). Entry ``w``
of a sequence (its tokens ``w*rate .. w*rate + rate - 1``, CSA also the window before) is a
pure function of those per-token rows, so it is pooled again from them each step: no
compressed page to keep in step with chunked prefill, preemption or prefix sharing, whatever
order the tokens came in. A query at ``t`` sees entry ``w`` once ``(w + 1) * rate <= t + 1``
(transformers' causal rule), and raw keys ``t - window < s <= t``.

- ``warmboot::compressed_attention(q, kv, side, iq, iw, ape, norm, iape, inorm, cos, sin,
  layer, rate, overlap, window, topk, eps)``: write the layer's new K and compressor rows,
  pool, select, attend; ``rate`` 0: the window alone.

One torch implementation for every device (the cost of dense attention over the context).
"""

from __future__ import annotations

import torch

from warmboot.kernels.sparse_attention import _gather, attend, select
from warmboot.kernels.step_ops import STEP_INDEX, StepContext, _context


def rope_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the last ``cos.shape[-1]`` dims of ``x`` (..., D); cos/sin
    broadcast over x's leading dims (full rotary width, pairs repeated)."""
    rd = cos.shape[-1]
    rot = x[..., -rd:]
    turned = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    out = (rot.float() * cos.float() + turned.float() * sin.float()).to(x.dtype)
    return torch.cat((x[..., :-rd], out), dim=-1)


def pool(
    side: torch.Tensor,  # (B, L, 2 * c * d): kv (c series) then gate (c series)
    ape: torch.Tensor,  # (rate, c * d): the gate's bias per place in a window
    norm: torch.Tensor,  # (d,)
    rate: int,
    overlap: bool,
    eps: float,
    cos: torch.Tensor,  # (P, rd) tables of the compress rope
    sin: torch.Tensor,
) -> torch.Tensor:  # (B, L // rate, d)
    """The compressed entries of every full window: a softmax over the gate (plus ``ape``)
    weighing the kv rows, RMS-normed, rotated at the window's first position. ``overlap``
    (CSA): two series per token, entry ``w`` pools window ``w``'s second and window
    ``w - 1``'s first (none before window 0)."""
    b, length, width = side.shape
    n, wide = length // rate, width // 2
    kv = side[:, : n * rate, :wide].reshape(b, n, rate, wide)
    gate = side[:, : n * rate, wide:].reshape(b, n, rate, wide) + ape
    if overlap:
        d = wide // 2
        prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
        blank = torch.full_like(gate[:, :1, :, :d], float("-inf"))
        prev_gate = torch.cat([blank, gate[:, :-1, :, :d]], dim=1)
        kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
    weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    pooled = (kv * weights).sum(dim=2)
    pf = pooled.float()
    pooled = norm.float() * (pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + eps))
    pooled = pooled.to(side.dtype)
    at = torch.arange(n, device=side.device) * rate
    return rope_last(pooled, cos[at], sin[at])


def compressed(ctx: StepContext, layer: int, q, kv, side, iq, iw, params, how) -> torch.Tensor:
    """``params``: (ape, norm, iape, inorm, cos, sin); ``how``: (rate, overlap, window,
    topk, eps)."""
    meta = ctx.meta
    if meta is None:
        raise RuntimeError("attention ran in a step without attention metadata")
    rate, overlap, window, topk, eps = how
    pages = ctx.kv_caches[layer]
    k_cache, rows_cache = pages[0], pages[-1]
    k_cache.view(-1, kv.shape[-1]).index_copy_(0, meta.slot_mapping, kv)
    if side.shape[-1]:
        flat = rows_cache.view(-1, rows_cache.shape[-1])[:, : side.shape[-1]]
        flat.index_copy_(0, meta.slot_mapping, side)
    spec, out = ctx.specs[layer], torch.empty_like(q)
    for rows, pos, table, length in _spans(meta):
        keys = _gather(k_cache, table)[:, :length].flatten(2)  # (B, L, D)
        span = torch.arange(keys.shape[1], device=q.device)
        mask = (span <= pos[..., None]) & (span > pos[..., None] - window)  # (B, R, L)
        if rate:
            inputs = _gather(rows_cache, table)[:, :length, : side.shape[-1]]
            comp, valid = _entries(inputs, pos, params, how)
            if overlap:  # NOTE: CSA: its indexer picks among the entries
                b, r = pos.shape
                ikeys, _ = _entries(inputs, pos, params, how, indexer=True)
                shape = (b, r, *iq.shape[1:])
                picked = select(iq[rows].view(shape), iw[rows].view(shape[:3]), ikeys, valid, topk)
                valid = picked[:, 0]
            keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, valid], dim=2)
        b, r = pos.shape
        qs = q[rows].view(b, r, *q.shape[1:])
        kk = keys.unsqueeze(2)
        out[rows] = attend(qs, kk, kk, mask.unsqueeze(1), spec.scale, spec.sinks).flatten(0, 1)
    return out


def _entries(inputs, pos, params, how, indexer: bool = False):
    """(entries (B, n, d), valid (B, R, n)) of the main compressor (or the indexer's) from
    the tokens' compressor rows ``inputs`` (B, L, main | indexer)."""
    rate, overlap, _, _, eps = how
    ape, norm, iape, inorm, cos, sin = params
    main = 2 * ape.shape[-1]
    if indexer:
        ents = pool(inputs[..., main:], iape, inorm, rate, overlap, eps, cos, sin)
    else:
        ents = pool(inputs[..., :main], ape, norm, rate, overlap, eps, cos, sin)
    w = torch.arange(ents.shape[1], device=pos.device)
    return ents, (w + 1) * rate <= pos[..., None] + 1


def _spans(meta):
    """(rows, query positions (B, R), block tables (B, blocks), keys to read) per group:
    the decodes together, then each prefill."""
    nd = meta.num_decode_tokens
    if nd:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        yield slice(0, nd), (lens - 1)[:, None], tables, tables.shape[1] * meta.block_size
    for p in meta.prefills:
        first = p.context_len - p.query_len
        pos = torch.arange(first, p.context_len, device=p.block_table.device)[None]
        rows = slice(p.query_start, p.query_start + p.query_len)
        yield rows, pos, p.block_table.unsqueeze(0), p.context_len


# -- the op a compiled step calls, and what the attention layer calls ----------------------------
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define(
    "compressed_attention(Tensor q, Tensor kv, Tensor side, Tensor iq, Tensor iw, Tensor ape, "
    "Tensor norm, Tensor iape, Tensor inorm, Tensor cos, Tensor sin, Tensor layer, int rate, "
    "bool overlap, int window, int topk, float eps) -> Tensor"
)


def _op(q, kv, side, iq, iw, ape, norm, iape, inorm, cos, sin, layer, *how):
    params = (ape, norm, iape, inorm, cos, sin)
    ctx = _context("compressed_attention")
    return compressed(ctx, int(layer), q, kv, side, iq, iw, params, how)


_LIB.impl("compressed_attention", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::compressed_attention")
def _(q, kv, side, iq, iw, ape, norm, iape, inorm, cos, sin, layer, *how):
    return torch.empty_like(q)


def call_compressed(module, step, q, kv, side, iq, iw, params, how) -> torch.Tensor:
    """The op in a compiled step (the module carries its layer's ``STEP_INDEX``), else the
    function on the eager step's context."""
    index = getattr(module, STEP_INDEX, None)
    if index is not None:
        return torch.ops.warmboot.compressed_attention(q, kv, side, iq, iw, *params, index, *how)
    return compressed(step, step.layer, q, kv, side, iq, iw, params, how)
