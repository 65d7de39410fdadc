"""CPU (and fallback) attention backend: torch SDPA over K/V gathered block by block.

GQA without copies: the query heads of one KV head are folded into the query-length axis,
so ``(heads_kv, group * q_len, D)`` attends to ``(heads_kv, ctx, D)`` and K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmboot.kernels.backend import AttentionBackend, AttentionMetadata, PrefillSeq


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, seq, scale, sliding_window)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, window):
        tables = meta.decode_block_tables  # (B, max_blocks)
        batch, max_blocks = tables.shape
        _, bs, hkv, d = k_cache.shape
        keys = k_cache[tables].view(batch, max_blocks * bs, hkv, d).transpose(1, 2)
        values = v_cache[tables].view(batch, max_blocks * bs, hkv, d).transpose(1, 2)
        mask = self._decode_mask(meta, max_blocks * bs, window, q.dtype)  # (B, 1, 1, L)
        qg = q.view(batch, hkv, -1, d)  # (B, Hkv, G, D)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, -1, d)

    @staticmethod
    def _decode_mask(
        meta: AttentionMetadata, length: int, window: int | None, dtype
    ) -> torch.Tensor:
        """Additive (B, 1, 1, L) mask, built once per step and window (SDPA would convert a
        boolean mask in every layer)."""
        key = ("decode_mask", window)
        if key not in meta.cache:
            lens = meta.decode_seq_lens.unsqueeze(1)  # (B, 1)
            pos = torch.arange(length, device=lens.device).unsqueeze(0)
            mask = pos < lens
            if window is not None:
                mask &= pos >= lens - window
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            meta.cache[key] = additive.masked_fill_(~mask, float("-inf"))[:, None, None, :]
        return meta.cache[key]

    def _prefill(self, q, k_cache, v_cache, seq: PrefillSeq, scale, window):
        n, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        group, ctx = hq // hkv, seq.context_len
        keys = k_cache[seq.block_table].view(-1, hkv, d)[:ctx].transpose(0, 1)  # (Hkv, ctx, D)
        values = v_cache[seq.block_table].view(-1, hkv, d)[:ctx].transpose(0, 1)
        qg = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
        mask = _causal_mask(n, ctx, window, q.device).repeat(group, 1)  # (G*n, ctx)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _causal_mask(q_len: int, ctx: int, window: int | None, device) -> torch.Tensor:
    """(q_len, ctx) bool, bottom-right aligned: query i sits at position ctx - q_len + i."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
