"""The runner's per-layer memory: the paged KV pool of the attention layers and the state
slots of the state layers (``KVLayout``), zeros that cost nothing on the CPU until written."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from warmboot.kernels.backend import KVLayout, StateSpec

Upload = Callable[[torch.Tensor], torch.Tensor]


class Pools:
    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._buffers: list[mmap.mmap] = []

    def release(self) -> None:
        self._buffers = []

    def kv(
        self, layout: KVLayout, num_layers: int, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, ...] | None]:
        """Per layer: its K and V pages ((blocks, block_size, heads, dim) each; one tensor as
        both for a 1-entry layout, which ``write_kv`` writes once), then its indexer keys'
        pages ((blocks, block_size, index_dim)) where the layout keeps them; a layer reading
        another's K/V (``KVLayout.kv_sources``) gets that layer's; None for a state layer."""
        owners = [i for i in range(num_layers) if layout.owns_kv(i)]
        if not owners:
            return [None] * num_layers
        shape = (len(owners), layout.entries, num_blocks, block_size, layout.heads, layout.dim)
        cache = self.zeros(shape, self.dtype)
        entries = {layer: cache[j].unbind(0) for j, layer in enumerate(owners)}
        pages = {layer: (kv[0], kv[-1]) for layer, kv in entries.items()}  # NOTE: one: K is V
        if layout.index_dim:
            keys = self.zeros((len(owners), num_blocks, block_size, layout.index_dim), self.dtype)
            pages = {layer: (*kv, keys[j]) for j, (layer, kv) in enumerate(pages.items())}
        sources = layout.kv_sources or (None,) * num_layers
        for i in range(num_layers):
            if sources[i] is not None and layout.attends(i):
                pages[i] = pages[sources[i]]
        return [pages.get(i) for i in range(num_layers)]

    def states(self, layout: KVLayout, rows: int) -> list[dict[str, torch.Tensor] | None]:
        """Per layer: a state layer's tensors by name, ``rows`` rows each; None for attention."""
        return [self._state(specs, rows) if specs else None for specs in layout.states]

    def _state(self, specs: tuple[StateSpec, ...], rows: int) -> dict[str, torch.Tensor]:
        return {
            s.name: self.zeros((rows, *s.shape), torch.float32 if s.float32 else self.dtype)
            for s in specs
        }

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        # NOTE: a fresh anonymous mapping reads as zeros without touching its pages, so a pool
        # costs nothing until it is written (and nothing in a process image).
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buffers.append(buffer)
        return torch.frombuffer(buffer, dtype=dtype).view(shape)


@dataclass
class StateMoves:
    """A step's copies between state rows (``core.state_prefix``): before its forward each
    sequence that starts at position 0 has its slot zeroed (``clear``) and one that starts at
    a cached prefix has it loaded from a checkpoint row (``load``: (row, slot)); after it,
    ``keep``: (slot, row) copies the states a sequence ends the step with. Interior saves (a
    boundary inside a prefill chunk) are the state ops' (``AttentionMetadata.state_saves``)."""

    clear: list[int] = field(default_factory=list)
    load: list[tuple[int, int]] = field(default_factory=list)
    keep: list[tuple[int, int]] = field(default_factory=list)


States = list[dict[str, torch.Tensor] | None]


def prepare_states(states: States, moves: StateMoves, upload: Upload) -> None:
    """Zero the ``clear`` slots and copy the ``load`` checkpoints into theirs, in every state
    layer. ``upload``: the runner's host -> device copy (no host sync on CUDA)."""
    if moves.clear:
        index = upload(torch.tensor(moves.clear))
        for tensor in _tensors(states):
            tensor.index_fill_(0, index, 0)
    _copy_rows(states, moves.load, upload)


def keep_states(states: States, moves: StateMoves, upload: Upload) -> None:
    _copy_rows(states, moves.keep, upload)


def _copy_rows(states: States, pairs: list[tuple[int, int]], upload: Upload) -> None:
    if not pairs:
        return
    src, dst = (upload(torch.tensor(rows)) for rows in zip(*pairs, strict=True))
    for tensor in _tensors(states):
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


def _tensors(states: States) -> list[torch.Tensor]:
    return [t for layer in states if layer for t in layer.values()]
