"""Sparse indexed attention (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5): a light indexer
scores every past key of a query, and the query attends only to the ``topk`` best.

Per query ``t`` and past position ``s`` (``s <= t``) the index score is

    I[t, s] = sum_h w[t, h] * relu(scale * q_I[t, h] . k_I[s])

with the indexer's queries ``q_I`` (H_I heads) and weights ``w`` of the query token, and the
indexer key ``k_I`` of each past token, which each attention layer keeps per token beside its
K/V in the paged cache (``KVLayout.index_dim``, ``Pools.kv``). The query then attends, as it
would densely, over the ``topk`` positions of highest score (all of them while it has no more
than ``topk``). Ties: among equal scores the earlier position is taken first (a stable sort), so
a selection never depends on the kernel's order of work.

- ``warmboot::indexed_attention(q, k, v, iq, ik, iw, layer, topk, reuse)``: write the layer's
  new K/V and indexer keys, select and attend. ``reuse``: take the selection the last indexing
  layer of the step made (GLM-5's ``shared`` layers, which have no indexer).

One torch implementation serves every device and both backends: the selection as a masked
dense score, the attention as SDPA under the selection's mask (cost of dense attention; a
gather of the selected positions is the long-context path still to write).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmboot.kernels.backend import AttentionMetadata, write_kv
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
    for j, (rows, kv_k, kv_v, index_keys, valid) in enumerate(
        _groups(meta, k_cache, v_cache, keys)
    ):
        b = valid.shape[0]
        if previous is not None:
            chosen = previous[j]
        elif block:
            chosen = select_blocks(
                iq[rows].view(b, -1, *iq.shape[1:]), index_keys, valid, topk, block, local
            )
        else:
            shape = (b, -1, *iq.shape[1:])
            chosen = select(
                iq[rows].view(shape), iw[rows].view(*shape[:3]), index_keys, valid, topk
            )
        picks.append(chosen)
        qs = q[rows].view(b, -1, *q.shape[1:])
        spec = ctx.specs[layer]
        out[rows] = attend(qs, kv_k, kv_v, chosen, spec.scale).flatten(0, 1)
    meta.cache[SELECTION] = picks
    return out


def _groups(meta: AttentionMetadata, k_cache, v_cache, keys):
    """The step's rows in groups that share a key span: the decodes together (a batch of one
    row each), then each prefill; per group (rows, K, V, indexer keys, valid) with K/V
    (B, L, Hkv, D), indexer keys (B, L, D_I) and valid (B, R, L): the causal span."""
    nd = meta.num_decode_tokens
    if nd:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        kk, vv, ii = (_gather(c, tables) for c in (k_cache, v_cache, keys))
        span = torch.arange(kk.shape[1], device=kk.device)
        yield slice(0, nd), kk, vv, ii, (span < lens[:, None]).unsqueeze(1)
    for p in meta.prefills:
        table = p.block_table.unsqueeze(0)
        kk, vv, ii = (_gather(c, table)[:, : p.context_len] for c in (k_cache, v_cache, keys))
        span = torch.arange(p.context_len, device=kk.device)
        first = p.context_len - p.query_len
        pos = torch.arange(first, p.context_len, device=kk.device)
        valid = (span[None, :] <= pos[:, None]).unsqueeze(0)
        yield slice(p.query_start, p.query_start + p.query_len), kk, vv, ii, valid


def _gather(pages: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """(B, blocks * block_size, ...) of the paged ``pages`` (blocks, block_size, ...)."""
    return pages[tables].flatten(1, 2)


def select(
    iq: torch.Tensor,  # (B, R, H_I, D_I)
    iw: torch.Tensor,  # (B, R, H_I) float32
    keys: torch.Tensor,  # (B, L, D_I)
    valid: torch.Tensor,  # (B, R, L) bool
    topk: int,
    scale: float | None = None,
) -> torch.Tensor:  # (B, R, L) bool
    """The positions each query attends to: its ``topk`` best index scores among ``valid``
    (ties to the earlier position), all of them when it has no more."""
    scale = iq.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(iq.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale
    index = torch.matmul(iw.unsqueeze(-2), F.relu(scores)).squeeze(-2)
    index = index.masked_fill(~valid, float("-inf"))
    order = torch.sort(index, dim=-1, descending=True, stable=True).indices[..., :topk]
    return (torch.zeros_like(valid).scatter_(-1, order, True) & valid).unsqueeze(1)


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
    best = scores.view(b, r, g, blocks, block).amax(-1)  # (B, R, G, blocks)
    own = (valid.sum(-1) - 1) // block  # (B, R): each query's block
    for back in range(local):
        at = (own - back).clamp(min=0)[:, :, None, None].expand(b, r, g, 1)
        best.scatter_(-1, at, float("inf"))
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices[..., :topk]
    taken = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, order, True)
    taken &= best > float("-inf")
    tokens = taken.repeat_interleave(block, dim=-1)[..., :length]  # (B, R, G, L)
    return tokens.transpose(1, 2) & valid.unsqueeze(1)


def attend(q, k, v, mask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, R, Hq, D) over k, v (B, L, Hkv, Dv) where ``mask`` (B, G, R, L) allows, G
    groups of query heads (one: every head alike); in float32 as transformers' eager
    attention. ``sinks``: (Hq,) logits in each row's softmax, without a value (HY-V4)."""
    mask = mask.repeat_interleave(q.shape[2] // mask.shape[1], dim=1)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    if sinks is None:
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True
        )
    else:
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
