"""Triton attention backend: the paged decode kernel for decode rows, the varlen kernel
reading K/V through the block table for prefill rows (chunked prefill over cached context
included). Same contract as ``TorchAttentionBackend``.

The decode path has no host synchronisation and no data-dependent Python (shapes only), so
a decode step can be captured in a CUDA graph. On the CPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``): slow, for tests only.
"""

from __future__ import annotations

import torch

from warmboot.engine.device import upload
from warmboot.kernels.attention import flash_attn_varlen_func
from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, write_kv
from warmboot.kernels.decode import paged_decode_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        # Engine window w: keys (pos - w, pos]; flash-attn's left window counts pos - left.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
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
                out=out[:nd],
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
                block_table=table,
                seqused_k=seqused_k,
                out=out[nd:],
            )
        return out


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
        cu_q = upload(torch.tensor(cu, dtype=torch.int32), device)
        ctx = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
        max_q = max(s.query_len for s in seqs)
        max_k = max(s.context_len for s in seqs)
        meta.cache[key] = (cu_q, upload(ctx, device), table, max_q, max_k)
    return meta.cache[key]
