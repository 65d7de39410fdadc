"""Triton attention backend: the paged decode kernel for decode rows, the varlen kernel
reading K/V through the block table for prefill rows (chunked prefill over cached context
included). Same contract as ``TorchAttentionBackend``.

The decode path has no host synchronisation and no data-dependent Python (shapes only), so
a decode step can be captured in a CUDA graph. On the CPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``): slow, for tests only.
"""

from __future__ import annotations

import torch
import triton

from warmboot.kernels import tuning
from warmboot.kernels.attention import flash_attn_varlen_func
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, KVLayout, write_kv
from warmboot.kernels.decode import paged_decode_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

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
        cap = 0.0 if softcap is None else float(softcap)
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        window = _window(sliding_window)
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                window,
                cap,
                out=out[:nd],
                sinks=sinks,
                chunk=chunk,
            )
        if meta.prefills:
            cu_q, seqused_k, table, max_q, max_k = _prefill_inputs(meta, q.device)
            flash_attn_varlen_func(
                q[nd:],
                k_cache,
                v_cache,
                cu_q,
                None,
                max_q,
                max_k,
                scale,
                causal=True,
                window_size=window,
                softcap=cap,
                block_table=table,
                seqused_k=seqused_k,
                out=out[nd:],
                sinks=sinks,
                chunk=chunk,
            )
        return out

    def check_layout(self, layout: KVLayout, num_heads: int) -> None:
        """The kernels pad any head dim up to 256 to a power of two and take any Hq multiple
        of Hkv (MLA's one latent head, values = keys, included); a wider entry is refused:
        DeepSeek-V2/V3's latent is 512 + 64 = 576 wide."""
        if layout.dim > MAX_HEAD_DIM:
            raise ValueError(
                f"the triton attention backend serves head dims up to {MAX_HEAD_DIM}; this "
                f"model's KV cache entry is {layout.dim} wide: use attention_backend='torch'"
            )
        if num_heads % layout.heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {layout.heads}")

    def pretune(self, k_cache, v_cache, num_heads, scale, windows, max_q, max_k) -> int:
        if k_cache.device.type != "cuda" or tuning.interpreting():
            return 0  # NOTE: the interpreter and the CPU use one fixed config
        shapes = tuning.prefill_shapes(max_q, max_k)
        for mask in sorted(windows, key=_mask_order):
            window, chunk = mask if isinstance(mask, tuple) else (mask, None)
            for q_len, k_len in shapes:
                prefill_probe(k_cache, v_cache, num_heads, scale, window, q_len, k_len, chunk)
        torch.cuda.synchronize(k_cache.device)
        return len(shapes) * len(windows)


MAX_HEAD_DIM = 256


def prefill_probe(
    k_cache, v_cache, num_heads, scale, window, q_len, k_len, chunk=None
) -> torch.Tensor:
    """One sequence's causal prefill of ``q_len`` queries over the cache's first ``k_len``
    keys (blocks 0, 1, ...), with the argument dtypes of the engine's launches (an int64
    table, int32 lengths: a different dtype would be another compiled variant); ``chunk``:
    a chunked layer's (``AttentionSpec.chunk``)."""
    dev, (_, bs, _, d) = k_cache.device, k_cache.shape
    i32 = dict(dtype=torch.int32, device=dev)
    q = torch.zeros(q_len, num_heads, d, dtype=k_cache.dtype, device=dev)
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        torch.tensor([0, q_len], **i32),
        None,
        q_len,
        k_len,
        scale,
        causal=True,
        window_size=_window(window),
        block_table=torch.arange(triton.cdiv(k_len, bs), dtype=torch.int64, device=dev)[None],
        seqused_k=torch.tensor([k_len], **i32),
        chunk=chunk,
    )


def _mask_order(mask) -> tuple[int, int]:
    """A pretune entry (a window or None, or a (window, chunk) pair) as a sort key."""
    window, chunk = mask if isinstance(mask, tuple) else (mask, None)
    return (-1 if window is None else window, -1 if chunk is None else chunk)


def _window(sliding_window: int | None) -> tuple[int, int]:
    """Engine window w: keys (pos - w, pos]; flash-attn's left window counts pos - left."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _prefill_inputs(meta: AttentionMetadata, device: torch.device):
    """(cu_seqlens_q, seqused_k, block_table, max_q, max_k) of the step's prefill rows, built
    once per step (every layer reuses them)."""
    key = ("triton_prefill",)
    if key not in meta.cache:
        seqs = meta.prefills
        start = meta.num_decode_tokens
        cu = [0]
        for s in seqs:
            if s.query_start != start + cu[-1]:
                raise ValueError("prefill rows must follow the decode rows contiguously")
            cu.append(cu[-1] + s.query_len)
        width = max(len(s.block_table) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int64, device=device)
        for i, s in enumerate(seqs):
            table[i, : len(s.block_table)] = s.block_table
        cu_q = meta.upload(torch.tensor(cu, dtype=torch.int32))
        ctx = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
        max_q = max(s.query_len for s in seqs)
        max_k = max(s.context_len for s in seqs)
        meta.cache[key] = (cu_q, meta.upload(ctx), table, max_q, max_k)
    return meta.cache[key]
