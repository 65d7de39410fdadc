"""CPU (and fallback) attention backend: the native paged kernels on the CPU
(``kernels.native.attention``: the blocks read in place), else torch SDPA over K/V gathered
block by block. On a CPU with AMX tiles a step's bfloat16 prefills take the native flash
kernel on the tiles (``native_attention.causal_prefill`` for fresh ones, ``paged_prefill``
over cached context), and chunks it does not take, of ``TILED_PREFILL_ROWS`` or more, SDPA.

GQA without copies of K/V: in decode the query heads of one KV head are folded into the
query-length axis, ``(B, Hkv, group, D)`` against ``(B, Hkv, ctx, D)``; prefill uses SDPA's
``enable_gqa`` (and its causal fast path when the chunk has no cached context). Soft-capped
scores and attention sinks are computed in steps (SDPA has neither).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmboot.kernels import native
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, PrefillSeq, write_kv
from warmboot.kernels.native import attention as native_attention

TILED_PREFILL_ROWS = 64
"""From this many query rows a bfloat16 prefill chunk that the flash kernel does not take
(a head size it lacks, a sliding window), where the CPU has AMX tiles, runs torch's SDPA
(its flash kernel multiplies on the tiles) instead of the native kernel's vector dot
products: 1.6x at 64 rows, 2.0x at 128, 3.1x at 2048 with no cached context, 2.3-2.5x over
cached context (K/V gathered), 0.8x at 16 rows, on a Xeon (``docs/benchmarks/intel/
kernels.md``). Not with soft-capping or sinks (SDPA has neither), and float32 keeps the
native kernel (SDPA is no faster there)."""


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native_kernels: bool | None = None):
        self._native = native_kernels
        """CPU steps attend with the native kernels (``kernels.native``): the paged blocks
        read in place; else (no library, or another device) SDPA over gathered copies.
        None: once the library is loaded (``native.ready``, first asked at the first step, so a
        restore places a snapshot's library before; a first build does not hold up a start),
        True: always (it loads now)."""
        if native_kernels:
            native_attention.available()

    @property
    def native(self) -> bool:
        return native.ready() if self._native is None else self._native

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        scale,
        sliding_window,
        softcap=None,
        sinks=None,
        chunk=None,
    ):
        native = self.native and q.device.type == "cpu"
        if not (native and native_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)):
            write_kv(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        # NOTE: sinks grouped like the queries, (Hkv, group, 1): query head h = kvh * group + g
        sinks = None if sinks is None else sinks.view(k.shape[1], -1, 1)
        opts = (sliding_window, softcap, sinks, chunk)
        if native and nd == q.shape[0]:  # NOTE: decodes only: the kernel's fresh output as is
            return self._decode(q, k_cache, v_cache, meta, scale, *opts)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, *opts)
        prefills = meta.prefills
        if native and prefills:
            prefills = self._flash_prefills(q, k, v, k_cache, v_cache, out, prefills, scale, *opts)
        for seq in prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill(
                q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale, *opts
            )
        return out

    def _decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale,
        window,
        softcap,
        sinks,
        chunk=None,
    ):
        tables = meta.decode_block_tables  # (B, max_blocks)
        if self.native and q.device.type == "cpu":
            lens, flat = meta.decode_seq_lens, _flat(sinks)
            return native_attention.paged_decode(
                q, k_cache, v_cache, tables, lens, scale, window, softcap, flat, chunk
            )
        batch, max_blocks = tables.shape
        _, bs, hkv, d = k_cache.shape
        keys = _gather(k_cache, tables, hkv, d).view(batch, -1, hkv, d).transpose(1, 2)
        values = keys  # NOTE: one cache for both (MLA's latent): gathered once
        if v_cache is not k_cache:
            values = _gather(v_cache, tables, hkv, d).view(batch, -1, hkv, d).transpose(1, 2)
        mask = self._decode_mask(meta, max_blocks * bs, window, q.dtype, chunk)  # (B, 1, 1, L)
        qg = q.view(batch, hkv, -1, d)  # (B, Hkv, G, D)
        out = _sdpa(qg, keys, values, mask, scale, softcap, sinks)
        return out.reshape(batch, -1, d)

    @staticmethod
    def _decode_mask(
        meta: AttentionMetadata, length: int, window: int | None, dtype, chunk=None
    ) -> torch.Tensor:
        """Additive (B, 1, 1, L) mask, built once per step, window and chunk (SDPA would
        convert a boolean mask in every layer)."""
        key = ("decode_mask", window, chunk)
        if key not in meta.cache:
            lens = meta.decode_seq_lens.unsqueeze(1)  # (B, 1)
            pos = torch.arange(length, device=lens.device).unsqueeze(0)
            mask = pos < lens
            if window is not None:
                mask &= pos >= lens - window
            if chunk is not None:  # NOTE: the new token sits at lens - 1
                mask &= pos >= lens - 1 - (lens - 1) % chunk
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            meta.cache[key] = additive.masked_fill_(~mask, float("-inf"))[:, None, None, :]
        return meta.cache[key]

    def _flash_prefills(
        self, q, k, v, k_cache, v_cache, out, seqs, scale, window, softcap, sinks, chunk=None
    ):
        """The step's prefills that native calls take, into ``out``, shared with the helper
        thread. Where the flash kernel runs (a window, chunks, sinks and soft-capping too):
        every fresh one (no cached context) in one ``causal_prefill`` call and those over cached
        context in one ``paged_prefill`` call. Otherwise (none of those four): the fresh ones
        that take SDPA (tiled: see ``_native_prefill``) in one ``causal_prefill`` call. Returns
        the others."""
        usable = scale is not None and k.shape == v.shape
        if not (usable and q.dtype == torch.bfloat16 and native.amx()):
            return seqs
        flash = native_attention.flash_prefill(q, k, v)
        options = (window, sinks, softcap, chunk)
        if not flash and any(o is not None for o in options):
            return seqs
        least = 1 if flash else TILED_PREFILL_ROWS
        fresh = [s.context_len == s.query_len >= least for s in seqs]
        if any(fresh):
            starts = [s.query_start for s, f in zip(seqs, fresh, strict=True) if f]
            lens = [s.query_len for s, f in zip(seqs, fresh, strict=True) if f]
            native_attention.causal_prefill(q, k, v, out, starts, lens, scale, *options)
        rest = [s for s, f in zip(seqs, fresh, strict=True) if not f]
        cached = flash and rest and v_cache is not k_cache  # NOTE: not MLA's one latent cache
        if cached and native_attention.paged_prefill(
            q, k_cache, v_cache, out, rest, scale, *options
        ):
            return []
        return rest

    def _native_prefill(self, q: torch.Tensor, softcap, sinks) -> bool:
        """Whether a prefill chunk runs the native kernel (else SDPA: ``TILED_PREFILL_ROWS``)."""
        if not (self.native and q.device.type == "cpu"):
            return False
        tiled = q.dtype == torch.bfloat16 and q.shape[0] >= TILED_PREFILL_ROWS
        return not (tiled and softcap is None and sinks is None and native.amx())

    def _prefill(
        self, q, k, v, k_cache, v_cache, seq: PrefillSeq, scale, window, softcap, sinks, chunk=None
    ):
        n, _, d = q.shape
        hkv, ctx = k.shape[1], seq.context_len
        if self._native_prefill(q, softcap, sinks):  # NOTE: the chunk's K/V is in the cache
            table, flat = seq.block_table, _flat(sinks)
            return native_attention.paged_extend(
                q, k_cache, v_cache, table, ctx, scale, window, softcap, flat, chunk
            )
        if ctx == n:  # nothing cached before this chunk: attend to the new k/v directly
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys = _gather(k_cache, seq.block_table, hkv, d)[:ctx].transpose(0, 1)  # (Hkv, ctx, D)
            values = keys
            if v_cache is not k_cache:
                values = _gather(v_cache, seq.block_table, hkv, d)[:ctx].transpose(0, 1)
        causal = ctx == n and window is None and softcap is None and sinks is None
        causal = causal and chunk is None
        mask = None if causal else _causal_mask(n, ctx, window, q.device, chunk)
        if softcap is not None or sinks is not None:
            # NOTE: GQA as (Hkv, group * n) query rows, no K/V copies
            group = q.shape[1] // hkv
            qg = q.transpose(0, 1).reshape(hkv, -1, d)
            rows_sinks = None if sinks is None else sinks.expand(hkv, group, n).reshape(hkv, -1, 1)
            out = _sdpa(qg, keys, values, mask.repeat(group, 1), scale, softcap, rows_sinks)
            return out.view(q.shape[1], n, d).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def _sdpa(q, k, v, mask, scale: float, softcap: float | None, sinks=None) -> torch.Tensor:
    """SDPA, or with soft-capped scores or sinks the same computed in steps as transformers
    does: ``softcap * tanh(q.k * scale / softcap)``, masked, softmax in float32; ``sinks``
    (broadcast to the scores' rows, one column) join the softmax as a column without a value.
    ``mask``: additive or boolean, broadcast over the leading dims."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    column = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores.float(), column], dim=-1), dim=-1)[..., :-1]
    return probs.to(q.dtype) @ v


def _flat(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sinks grouped as (Hkv, group, 1) back to (Hq,), query head order."""
    return None if sinks is None else sinks.reshape(-1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, hkv: int, d: int) -> torch.Tensor:
    """(num_blocks, bs, Hkv, D) cache, (n,) block ids -> (n * bs, Hkv, D) contiguous copy.
    NOTE: rows of a 2-D view: index_select copies them 3x faster than 4-D slices."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.flatten())
    return rows.view(-1, hkv, d)


def _causal_mask(q_len: int, ctx: int, window: int | None, device, chunk=None) -> torch.Tensor:
    """(q_len, ctx) bool, bottom-right aligned: query i sits at position ctx - q_len + i;
    with ``chunk``, only keys in the query's chunk of that many positions."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos >= q_pos - q_pos % chunk
    return mask
