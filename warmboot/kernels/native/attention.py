"""Paged attention over the KV cache in place (``csrc/paged_attention.cpp``): no gather, no copy.

``paged_decode``: one query token per sequence against its blocks; ``paged_extend``: a prefill
chunk of one sequence (causal, bottom-right aligned) against its blocks, the chunk's own K/V
already written. Both take q and the caches in one dtype (float32, bfloat16 or float16),
accumulate in float32 with a streaming softmax, and return a fresh (tokens, Hq, D) tensor in
q's dtype. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``; ``v_cache`` may be
``k_cache`` itself (MLA's latent cache). The ops have Meta kernels, so ``torch.compile`` can
trace them.

Call ``available()`` before the first use: it builds or loads the library that registers
the ops.
"""

from __future__ import annotations

import torch

from warmboot.kernels import native


def available() -> bool:
    """Whether the ops are registered (the native library built and loaded)."""
    return native.library() is not None


def write_kv(k, v, k_cache, v_cache, slots: torch.Tensor) -> bool:
    """The step's new K/V rows (N, Hkv, D) into the caches at ``slots`` in one call
    (``csrc/write_kv.cpp``); False, nothing written, where the op does not take them: one
    cache serving as both, another dtype, a token's row not contiguous."""
    if v_cache is k_cache or not (_rows(k, k_cache) and _rows(v, k_cache)):
        return False
    torch.ops.warmboot_cpu.write_kv(k, v, k_cache, v_cache, slots)
    return True


FLASH_MAX_DIM = 256
"""The largest head_dim ``causal_prefill``'s AMX flash kernel takes (``kMaxDim``)."""


def flash_prefill(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether ``causal_prefill`` runs its flash kernel on AMX tiles for ``q`` and the step's
    own K/V rows ``kv`` (bfloat16, each token's heads contiguous, head_dim a multiple of 32 up
    to ``FLASH_MAX_DIM``, the tiles usable here): faster than SDPA and the native kernel from 8
    tokens on (``docs/benchmarks/intel/kernels.md``)."""
    d = q.shape[-1]
    rows = all(
        t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.stride(-2) == d for t in (q, *kv)
    )
    return rows and d % 32 == 0 and d <= FLASH_MAX_DIM and native.amx()


def causal_prefill(
    q,
    k,
    v,
    out,
    starts: list[int],
    lens: list[int],
    scale: float,
    window=None,
    sinks=None,
    softcap=None,
    chunk=None,
) -> None:
    """Fresh prefills (no cached context: causal over their own K/V, the rows ``starts[i]``
    .. ``+ lens[i]`` of q, k, v) into the same rows of ``out``, shared with the helper
    threads (``csrc/causal_prefill.cpp``): flash attention on AMX tiles where
    ``flash_prefill`` (each row within bf16 SDPA's error of a float64 reference), else an
    SDPA call per sequence and KV head (its bits). ``window`` (positions a row sees, its own
    included), ``sinks`` (one logit per query head), ``softcap`` (scores capped to
    ``softcap * tanh(score / softcap)``, Gemma 2's) and ``chunk`` (a row at ``p`` sees
    ``p - p % chunk`` .. ``p`` only) take the flash kernel."""
    torch.ops.warmboot_cpu.causal_prefill(
        q, k, v, out, starts, lens, scale, window or 0, _sinks(sinks), softcap or 0.0, chunk or 0
    )


def paged_prefill(
    q, k_cache, v_cache, out, seqs, scale: float, window=None, sinks=None, softcap=None, chunk=None
) -> bool:
    """Prefill chunks over cached context (``seqs``: ``PrefillSeq``-likes, each chunk's rows
    ``query_start`` .. ``+ query_len`` of q the last of its ``context_len`` positions, whose
    K/V are all in the caches already) through the flash kernel into the same rows of ``out``,
    K/V repacked from the blocks of each ``block_table`` where they lie (no gather); False,
    nothing done, where the kernel does not fit (``flash_prefill``; the caches bf16 rows).
    ``window``, ``sinks``, ``softcap`` and ``chunk`` as for ``causal_prefill``."""
    return bool(
        torch.ops.warmboot_cpu.paged_prefill(
            q,
            k_cache,
            v_cache,
            out,
            [s.query_start for s in seqs],
            [s.query_len for s in seqs],
            [s.context_len for s in seqs],
            [s.block_table for s in seqs],
            scale,
            window or 0,
            _sinks(sinks),
            softcap or 0.0,
            chunk or 0,
        )
    )


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None else sinks.reshape(-1)


def _rows(x: torch.Tensor, cache: torch.Tensor) -> bool:
    return (
        x.dim() == 3 and x.dtype == cache.dtype and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    )


def paged_decode(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # same shape, or k_cache itself
    block_tables: torch.Tensor,  # (B, max_blocks) int64, padded with any valid block id
    seq_lens: torch.Tensor,  # (B,) int64, context length including the new token
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (Hq,) logits
    chunk: int | None = None,  # the token at p sees p - p % chunk .. p only
) -> torch.Tensor:  # (B, Hq, D)
    """One decode token per sequence; a sequence of length 0 gets zeros."""
    opts = (window or 0, softcap or 0.0, sinks, chunk or 0)
    return torch.ops.warmboot_cpu.paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, *opts
    )


def paged_extend(
    q: torch.Tensor,  # (N, Hq, D): the chunk's tokens, positions context_len - N ..
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (num_blocks,) int64 covering context_len
    context_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # (N, Hq, D)
    """A prefill chunk of one sequence against its cached context and itself (causal)."""
    opts = (window or 0, softcap or 0.0, sinks, chunk or 0)
    return torch.ops.warmboot_cpu.paged_extend(
        q, k_cache, v_cache, block_table, context_len, scale, *opts
    )
