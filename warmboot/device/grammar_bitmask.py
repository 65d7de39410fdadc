"""The packed token bitmask of grammar-constrained sampling: one int32 row per logits row,
bit ``i`` of a row set = token ``i`` allowed. ``GrammarMatcher.fill_bitmask`` fills a row on the
host; ``apply_bitmask`` turns the unset bits into ``-inf`` logits (xgrammar's C++ kernel on
CPU, a few torch ops on an accelerator)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from warmboot.device.staging import upload
from warmboot.device.xgrammar_import import import_xgrammar


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask of shape ``(batch, ceil(vocab_size / 32))`` on CPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Make ``bitmask[row]`` allow exactly ``token_ids``."""
    bitmask[row] = 0
    for t in token_ids:
        bitmask[row, t // 32] |= _bit(t % 32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed tokens of ``logits[r]`` to ``-inf`` for each ``r`` in ``rows``.

    Row ``r`` of ``logits`` (2-D, float32/bf16/fp16) uses row ``r`` of ``bitmask``; other rows
    are untouched. ``logits`` and ``bitmask`` must be on the same device (CPU or e.g. CUDA).
    Only the first ``min(logits.shape[1], 32 * bitmask.shape[1])`` columns are masked.
    """
    rows = [int(r) for r in rows]
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask needs 2-D logits and a 2-D int32 bitmask")
    if logits.device != bitmask.device:
        raise ValueError(f"logits on {logits.device} but bitmask on {bitmask.device}")
    n_rows = min(logits.shape[0], bitmask.shape[0])
    if min(rows) < 0 or max(rows) >= n_rows:
        raise IndexError(f"rows {rows} out of range for {n_rows} rows")
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        # xgrammar's C++ CPU kernel (its "auto" backend picks it for CPU tensors too).
        import_xgrammar().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=vocab, indices=rows, backend="cpu"
        )
    else:
        # Not xgrammar's default for CUDA (a Triton kernel): that needs triton installed and
        # JIT-compiles on first use; a few torch ops are enough for a (rows, vocab) mask.
        _apply_bitmask_torch(logits, bitmask, rows, vocab)


def _apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int
) -> None:
    idx = upload(torch.tensor(rows, dtype=torch.int64), logits.device)  # NOTE: no hidden sync
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[idx].unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[idx, :vocab] = logits[idx, :vocab].masked_fill(~allowed, float("-inf"))


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word as a Python int (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i
