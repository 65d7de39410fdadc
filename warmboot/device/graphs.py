"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed for every
decode-only step whose batch fits a bucket (padded up to it).

A graph bakes in device addresses, so its inputs live in static buffers that each step
overwrites, in stream order, before the replay: token ids, positions, slot mapping, block
tables (``width`` columns: enough for ``max_model_len``) and sequence lengths. Padding rows
write their K/V into the scratch block (one block past the block manager's pool) and attend
to that one key only, so they never touch a live request's blocks. Columns of a block table
past a row's length may hold stale block ids: kernels read only the blocks below
``seq_len``, and every id stays inside the cache.

``emulate=True`` (CPU tests): the same static buffers and padding, "replayed" by running
the forward eagerly, so everything but the capture itself is exercised without a GPU.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable

import torch

from warmboot.kernels.backend import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids, positions, meta) -> (batch, vocab) float32 logits."""


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16, up to ``max_num_seqs`` (always included)."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        batch_sizes: tuple[int, ...],
        width: int,
        block_size: int,
        scratch_block: int,
        emulate: bool = False,
    ):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"graph batch sizes must be >= 1, got {batch_sizes}")
        if not emulate and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.forward = forward
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.width = width
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.emulate = emulate
        top = self.batch_sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slot_mapping = torch.full((top,), self.scratch_slot, **i64)
        self.block_tables = torch.full((top, width), scratch_block, **i64)
        self.seq_lens = torch.ones(top, **i64)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()
        """Steps run per batch size."""

    def bucket(self, num_rows: int) -> int | None:
        """The smallest captured batch size that holds ``num_rows``, or None."""
        i = bisect.bisect_left(self.batch_sizes, num_rows)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
            prefills=[],
            block_size=self.block_size,
        )

    def _run_eager(self, batch: int) -> torch.Tensor:
        return self.forward(self.input_ids[:batch], self.positions[:batch], self._meta(batch))

    def capture(self, stream: torch.cuda.Stream | None) -> None:
        """Capture every bucket, largest first (they share one memory pool). Each capture is
        preceded by an eager run on the same stream: it compiles and autotunes the kernels,
        which must not happen inside a capture. The static buffers hold padding rows only."""
        if self.emulate:
            return
        torch.cuda.synchronize()  # NOTE: the buffers' fills ran on the default stream
        pool = None
        with torch.no_grad():
            for batch in reversed(self.batch_sizes):
                with torch.cuda.stream(stream):
                    self._run_eager(batch)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._run_eager(batch)
                pool = graph.pool()
                self._graphs[batch] = (graph, logits)
        stream.synchronize()

    def run(
        self,
        batch: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        patch_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Load a step padded to ``batch`` rows (host tensors, pinned on CUDA) into the static
        buffers, let ``patch_ids`` write device-fed tokens into the ids buffer, replay.
        Returns the (batch, vocab) logits; the graph's buffer, valid until the next replay."""
        tables = meta.decode_block_tables
        if input_ids.shape[0] != batch or tables.shape[0] != batch:
            raise ValueError(f"a graph step needs exactly {batch} rows, padding included")
        if tables.shape[1] > self.width:
            raise ValueError(f"block tables of {tables.shape[1]} columns exceed {self.width}")
        copy = dict(non_blocking=True)
        self.input_ids[:batch].copy_(input_ids, **copy)
        self.positions[:batch].copy_(positions, **copy)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, **copy)
        self.seq_lens[:batch].copy_(meta.decode_seq_lens, **copy)
        self.block_tables[:batch, : tables.shape[1]].copy_(tables, **copy)
        if patch_ids is not None:
            patch_ids(self.input_ids[:batch])
        self.replays[batch] += 1
        if self.emulate:
            return self._run_eager(batch)
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits
