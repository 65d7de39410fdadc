"""Tensors a process snapshot keeps in the store rather than in its image.

Before a tier-P checkpoint the worker moves the weights it packed for the GEMM
(``kernels.step_ops.PackedLinears``) out of anonymous memory: each is put into the store
as chunks and mapped back from those files, so the image holds none of them and the
restored process needs no repack. Inside gVisor a repack is costly: every page of fresh
memory is a trapped fault (a 512 MB fill takes 0.36 s there against 0.21 s natively, while
reading a mapped file that is in the page cache takes 0.04 s), and it packs every weight
again. The chunks are listed with the process image's mapped chunks, so no ``rm`` collects
them while the image exists and the launcher reads them ahead while runsc restores.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from warmboot.snapshot.image import chunk_hash
from warmboot.snapshot.restore import map_chunks
from warmboot.snapshot.store import Store

CHUNK_BYTES = 64 << 20
"""A whole number of pages: a tensor's chunks map back to back."""


def stashable(tensor: torch.Tensor | None) -> bool:
    return (
        tensor is not None
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and tensor.numel() > 0
    )


def stash(store: Store, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """(``tensor``'s bytes as store chunks, mapped from them; the chunks: hash -> size)."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr()))
    chunks = []
    for offset in range(0, nbytes, CHUNK_BYTES):
        data = raw[offset : offset + CHUNK_BYTES]
        h = chunk_hash(data)
        store.put_chunk(h, data)
        chunks.append((h, len(data)))
    mapped = map_chunks(store, chunks, tensor.dtype).view(tensor.shape)
    return mapped, dict(chunks)


def keeper(store: Store) -> tuple[Callable[[torch.Tensor], torch.Tensor | None], dict[str, int]]:
    """(a ``keep`` for ``PackedLinears.stash``: each tensor it can keep is stashed in ``store``
    and returned mapped from there, others None; the chunks it stashed: hash -> size)."""
    refs: dict[str, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor | None:
        if not stashable(tensor):
            return None
        mapped, chunks = stash(store, tensor)
        refs.update(chunks)
        return mapped

    return keep, refs
