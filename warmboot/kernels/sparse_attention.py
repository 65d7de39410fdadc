"""Sparse indexed attention: a light indexer scores the past keys of a query, and the query
attends only to the best (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5, A.X-K2, HY-V4,
dots3-note; MiniMax-M3's blocks).

Per query ``t`` and past position ``s`` (``s <= t``) DeepSeek's index score is

    I[t, s] = sum_h w[t, h] * relu(scale * q_I[t, h] . k_I[s])

with the indexer's queries ``q_I`` (H_I heads) and weights ``w`` of the query token, and the
indexer key ``k_I`` of each past token, which each attention layer keeps per token beside its
K/V in the paged cache (``KVLayout.index_dim``, ``Pools.kv``). The query then attends, as it
would densely, over the ``topk`` positions of highest score (all of them while it has no more
than ``topk``). Ties: among equal scores the earlier position is taken first (``best``), so
a selection never depends on the kernel's order of work. MiniMax-M3 picks blocks of positions
per KV head instead (``select_blocks``).

- ``warmboot::indexed_attention(q, k, v, iq, ik, iw, layer, topk, block, local, reuse)``: write
  the layer's new K/V and indexer keys, select and attend. ``reuse``: take the selection the
  last indexing layer of the step made (GLM-5's ``shared`` layers, which have no indexer).

One torch implementation serves every device and both backends. A decode row attends over its
chosen positions alone: on the CPU the native paged decode kernel reads them in place (the
cache as blocks of one slot), elsewhere SDPA over them gathered. A prefill chunk attends by
SDPA under the selection's mask (the cost of dense attention). The scores are float32, as
transformers computes them, over the paged keys a span at a time (``_paged_scores``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmboot.kernels.backend import AttentionMetadata, write_kv
from warmboot.kernels.native import attention as native_attention
from warmboot.kernels.step_ops import STEP_INDEX, StepContext, _context

SELECTION = "index_selection"
"""``AttentionMetadata.cache`` key: the last indexing layer's picks, for layers reusing them."""


def indexed(
    ctx: StepContext,
    layer: int,
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    iq: torch.Tensor,  # (N, H_I, D_I), rotated
    ik: torch.Tensor,  # (N, D_I), rotated
    iw: torch.Tensor,  # (N, H_I) float32, the head weights times their scale; (N, 0): blocks
    how: tuple[int, int, int, bool],
) -> torch.Tensor:  # (N, Hq, D)
    """``how``: (topk, block, local, reuse): ``block`` 0 picks ``topk`` positions
    (``select``), else ``topk`` blocks of ``block`` positions per indexer head
    (``select_blocks``, ``local`` blocks before each query's always in)."""
    meta = ctx.meta
    if meta is None:
        raise RuntimeError("attention ran in a step without attention metadata")
    topk, block, local, reuse = how
    k_cache, v_cache, keys = ctx.kv_caches[layer]
    write_kv(k, v, k_cache, v_cache, meta)
    if not reuse:
        keys.view(-1, keys.shape[-1]).index_copy_(0, meta.slot_mapping, ik)
    previous = meta.cache.get(SELECTION) if reuse else None
    if reuse and previous is None:
        raise RuntimeError("a layer reusing the index selection ran before any indexing layer")
    picks, out = [], torch.empty_like(q)
    spec = ctx.specs[layer]
    for j, (rows, table, length, valid) in enumerate(_groups(meta, k_cache.device)):
        b = valid.shape[0]
        shape = (b, -1, *iq.shape[1:])
        if previous is not None:
            chosen = previous[j]
        elif block:
            index_keys = _gather(keys, table)[:, :length]
            chosen = select_blocks(iq[rows].view(shape), index_keys, valid, topk, block, local)
        else:
            index = _paged_scores(iq[rows].view(shape), iw[rows].view(*shape[:3]), keys, table)
            index = index[..., :length].masked_fill_(~valid, float("-inf"))
            chosen = (best(index, topk) & valid).unsqueeze(1)
        picks.append(chosen)
        qs = q[rows].view(b, -1, *q.shape[1:])
        if chosen.shape[1] == 1 and qs.shape[1] == 1:  # NOTE: decodes: the chosen alone
            slots, count = _chosen_slots(table, chosen[:, 0, 0], topk, k_cache.shape[1])
            if _native(ctx, q, k_cache):
                out[rows] = _native_decode(q[rows], k_cache, v_cache, slots, count, spec)
                continue
            kk, vv = (_at_slots(c, slots) for c in (k_cache, v_cache))
            real = torch.arange(slots.shape[1], device=slots.device) < count[:, None]
            out[rows] = attend(qs, kk, vv, real[:, None, None], spec.scale, spec.sinks)[:, 0]
            continue
        kk, vv = (_gather(c, table)[:, :length] for c in (k_cache, v_cache))
        out[rows] = attend(qs, kk, vv, chosen, spec.scale, spec.sinks).flatten(0, 1)
    meta.cache[SELECTION] = picks
    return out


def _groups(meta: AttentionMetadata, device: torch.device):
    """The step's rows in groups that share a key span: the decodes together (a batch of one
    row each), then each prefill; per group (rows, block table (B, W), span length L, valid
    (B, R, L): each row's causal span)."""
    nd = meta.num_decode_tokens
    if nd:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        span = torch.arange(tables.shape[1] * meta.block_size, device=device)
        yield slice(0, nd), tables, span.shape[0], (span < lens[:, None]).unsqueeze(1)
    for p in meta.prefills:
        span = torch.arange(p.context_len, device=device)
        pos = torch.arange(p.context_len - p.query_len, p.context_len, device=device)
        valid = (span[None, :] <= pos[:, None]).unsqueeze(0)
        rows = slice(p.query_start, p.query_start + p.query_len)
        yield rows, p.block_table.unsqueeze(0), p.context_len, valid


def _chosen_slots(tables, chosen, topk: int, block: int):
    """The cache slots (B, k) of each decode row's chosen positions (``chosen`` (B, L)),
    earliest first, and how many there are (a row may choose fewer than ``topk``)."""
    length = chosen.shape[-1]
    order = torch.arange(length, 0, -1, device=chosen.device, dtype=torch.int32)
    idx = (chosen.to(torch.int32) * order).topk(min(topk, length), dim=-1, sorted=True).indices
    count = chosen.sum(-1)  # NOTE: idx holds them first (the highest ranks), earliest first
    return tables.gather(1, idx // block) * block + idx % block, count


def _at_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(B, k, H, D) of the paged ``cache`` at ``slots`` (B, k)."""
    return cache.view(-1, *cache.shape[-2:])[slots]


def _native(ctx: StepContext, q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the native paged decode kernel takes the sparse decode rows."""
    native = getattr(ctx.backend, "native", False)
    return native and q.device.type == "cpu" and q.dtype == cache.dtype


def _native_decode(q, k_cache, v_cache, slots, count, spec) -> torch.Tensor:
    """The native paged decode kernel over the chosen positions alone: the cache read as
    blocks of one slot, each row's table its chosen slots (no copy)."""
    keys = k_cache.view(-1, 1, *k_cache.shape[-2:])
    values = keys if v_cache is k_cache else v_cache.view(-1, 1, *v_cache.shape[-2:])
    sinks = None if spec.sinks is None else spec.sinks.float()
    return native_attention.paged_decode(q, keys, values, slots, count, spec.scale, sinks=sinks)


def _gather(pages: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """(B, blocks * block_size, ...) of the paged ``pages`` (blocks, block_size, ...)."""
    return pages[tables].flatten(1, 2)


def select(
    iq: torch.Tensor,  # (B, R, H_I, D_I)
    iw: torch.Tensor,  # (B, R, H_I) float32
    keys: torch.Tensor,  # (B, L, D_I)
    valid: torch.Tensor,  # (B, R, L) bool
    topk: int,
) -> torch.Tensor:  # (B, 1, R, L) bool
    """The positions each query attends to: its ``topk`` best index scores among ``valid``
    (ties to the earlier position), all of them when it has no more."""
    index = index_scores(iq, iw, keys).masked_fill_(~valid, float("-inf"))
    return (best(index, topk) & valid).unsqueeze(1)


def index_scores(iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, R, L) float32: ``sum_h w_h * relu(scale * q_h . k)``, as transformers orders it."""
    scores = torch.matmul(iq.float(), keys.float().transpose(-1, -2).unsqueeze(1))
    scores = scores.mul_(iq.shape[-1] ** -0.5).relu_()  # NOTE: in place: the big one
    return torch.matmul(iw.unsqueeze(-2), scores).squeeze(-2)


SCORE_SPAN = 4096
"""Positions scored at a time: the temporaries (keys gathered and in float32, the per-head
scores) stay under glibc's 32 MB ceiling for heap reuse, so each step reuses them instead of
faulting fresh pages in (2x a whole step at batch 8 and 16k tokens, a 2-core Xeon)."""


def _paged_scores(iq, iw, pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``index_scores`` over the keys ``table``'s blocks hold, ``SCORE_SPAN`` at a time
    (B, R, table width * block size)."""
    span = max(SCORE_SPAN // pages.shape[1], 1)
    parts = [
        index_scores(iq, iw, _gather(pages, table[:, first : first + span]))
        for first in range(0, table.shape[1], span)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A mask of the ``k`` highest ``scores`` along the last dim, ties to the earlier: the
    k-th value found by ``topk``, then those above it and the earliest of those equal."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above, ties = scores > kth, scores == kth
    room = k - above.sum(-1, keepdim=True)
    return above | (ties & (ties.cumsum(-1) <= room))


def select_blocks(
    iq: torch.Tensor,  # (B, R, G, D_I): one indexer head per KV head
    keys: torch.Tensor,  # (B, L, D_I)
    valid: torch.Tensor,  # (B, R, L) bool
    topk: int,
    block: int,
    local: int,
) -> torch.Tensor:  # (B, G, R, L) bool
    """MiniMax-M3's block selection: per indexer head, a block of ``block`` positions
    (counted from position 0) scores the best of its past keys' ``q . k``; each query takes
    its ``local`` blocks back from its own, then the best others up to ``topk`` blocks
    (ties to the earlier block), and attends to their past positions."""
    b, r, g, _ = iq.shape
    length = keys.shape[1]
    scores = torch.matmul(iq.float(), keys.float().transpose(-1, -2).unsqueeze(1))
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    blocks = -(-length // block)
    scores = F.pad(scores, (0, blocks * block - length), value=float("-inf"))
    pooled = scores.view(b, r, g, blocks, block).amax(-1)  # (B, R, G, blocks)
    own = (valid.sum(-1) - 1) // block  # (B, R): each query's block
    for back in range(local):
        at = (own - back).clamp(min=0)[:, :, None, None].expand(b, r, g, 1)
        pooled.scatter_(-1, at, float("inf"))
    taken = best(pooled, topk) & (pooled > float("-inf"))
    tokens = taken.repeat_interleave(block, dim=-1)[..., :length]  # (B, R, G, L)
    return tokens.transpose(1, 2) & valid.unsqueeze(1)


def attend(q, k, v, mask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, R, Hq, D) over k, v (B, L, Hkv, Dv) where ``mask`` (B, G, R, L) allows, G
    groups of query heads (one: every head alike); the softmax in float32, as transformers'
    eager attention. ``sinks``: (Hq,) logits in each row's softmax, without a value (HY-V4)."""
    mask = mask.repeat_interleave(q.shape[2] // mask.shape[1], dim=1)
    if sinks is None:  # NOTE: SDPA accumulates a bf16 softmax in float32 itself
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    out = _attend_with_sinks(qf, kf, vf, mask, scale, sinks)
    return out.transpose(1, 2).to(q.dtype)


def _attend_with_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """q (B, Hq, R, D), k/v (B, Hkv, L, D), mask (B, Hq, R, L): a softmax over the allowed
    scores and each head's sink logit, the sink's share dropped."""
    b, hq, r, _ = q.shape
    hkv, length = k.shape[1], k.shape[2]
    grouped = q.reshape(b, hkv, hq // hkv * r, -1)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).view(b, hq, r, length) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, r, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(b, hkv, hq // hkv * r, length), v)
    return out.view(b, hq, r, -1)


# -- the op a compiled step calls, and what an indexed attention layer calls ---------------------
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define(
    "indexed_attention(Tensor q, Tensor k, Tensor v, Tensor iq, Tensor ik, Tensor iw, "
    "Tensor layer, int topk, int block, int local, bool reuse) -> Tensor"
)


def _op(q, k, v, iq, ik, iw, layer, topk, block, local, reuse):
    how = (topk, block, local, reuse)
    return indexed(_context("indexed_attention"), int(layer), q, k, v, iq, ik, iw, how)


_LIB.impl("indexed_attention", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::indexed_attention")
def _(q, k, v, iq, ik, iw, layer, topk, block, local, reuse):
    return torch.empty_like(q)


def call_indexed(module, step, q, k, v, iq, ik, iw, how: tuple[int, int, int, bool]):
    """The op in a compiled step (the module carries its layer's ``STEP_INDEX``), else the
    function on the eager step's context; ``how`` as ``indexed``'s."""
    index = getattr(module, STEP_INDEX, None)
    if index is not None:
        return torch.ops.warmboot.indexed_attention(q, k, v, iq, ik, iw, index, *how)
    return indexed(step, step.layer, q, k, v, iq, ik, iw, how)
