"""Restore an image's tensors with reading, verifying and copying overlapped.

Three paths, picked by destination and store:

* CPU (the default): worker threads read each chunk (parallel ranged GETs on S3) straight
  into its slice of the destination tensor, then hash it there. The tensors live in
  anonymous memory: a running engine is immune to what later happens to the store's files
  (edited in place, truncated, removed).
* CPU, local store, ``use_mmap=True``: every chunk file is memory-mapped straight into one
  address range per tensor (``MAP_FIXED`` over a reservation; chunk offsets are page-aligned),
  so the tensor *is* the page cache, like the safetensors loader's zero-copy path. Faster and
  shared between processes, but a private file mapping still shows later in-place edits of
  pages it has not written, and a truncated chunk file kills the process with SIGBUS: only
  for stores nobody else writes (docs/benchmarks/store_faults.md measures both).
* CUDA (NOTE: untested, no GPU on the development machine): workers read each chunk into one
  of a set of pinned staging buffers, hash it, and enqueue an async copy on a copy stream;
  a buffer is reused once its copy's event has completed.

Every chunk is verified before ``restore_tensors`` returns; any failure raises (an
``IntegrityError``, a ``StoreError``, an ``OSError``) and no tensor escapes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import sys
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from warmboot.snapshot.image import (
    PAGE_SIZE,
    IntegrityError,
    Manifest,
    TensorEntry,
    dtype_from_name,
    verify_chunk,
)
from warmboot.snapshot.store import Store, open_regular

Progress = Callable[[int], None]
_MAP_FIXED = 0x10
_MADV_WILLNEED = 3


def restore_tensors(
    store: Store,
    manifest: Manifest,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    workers: int | None = None,
    use_mmap: bool = False,
) -> dict[str, torch.Tensor]:
    """name -> tensor on ``device``, every chunk verified against its hash."""
    device = torch.device(device)
    workers = workers or store.parallelism
    if device.type == "cuda":
        return _restore_cuda(store, manifest, device, progress, workers)
    mappable = use_mmap and _can_mmap(store, manifest)
    fill = _mapped_tensor if mappable else _read_tensor
    out = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="snapshot-restore") as pool:
        jobs = []
        for entry in manifest.tensors:
            tensor, tasks = fill(store, entry)
            out[entry.name] = tensor
            jobs += [pool.submit(_run, task, progress) for task in tasks]
        _wait_all(jobs)
    return out


def _wait_all(jobs: list) -> None:
    """Wait for every job; on the first failure cancel the rest and raise it."""
    try:
        for job in jobs:
            job.result()
    except BaseException:
        for job in jobs:
            job.cancel()
        raise


def _run(task: Callable[[], int], progress: Progress | None) -> None:
    n = task()
    if progress:
        progress(n)


def _spans(entry: TensorEntry) -> Iterator[tuple[int, int, str]]:
    offset = 0
    for c in entry.chunks:
        yield offset, c.size, c.hash
        offset += c.size


def _empty(entry: TensorEntry, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device=device)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


# -- CPU: read into the destination ---------------------------------------------------------
def _read_tensor(store: Store, entry: TensorEntry):
    tensor = _empty(entry)
    raw = memoryview(_byte_view(tensor).numpy()).cast("B") if tensor.numel() else memoryview(b"")

    def task(offset: int, size: int, h: str) -> Callable[[], int]:
        def run() -> int:
            view = raw[offset : offset + size]
            store.read_chunk(h, view)
            verify_chunk(view, h, f"tensor {entry.name}")
            return size

        return run

    return tensor, [task(*span) for span in _spans(entry)]


# -- CPU: map local chunk files into place ----------------------------------------------------
def _can_mmap(store: Store, manifest: Manifest) -> bool:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    if manifest.chunk_bytes % PAGE_SIZE or not manifest.tensors:
        return False
    return store.local_chunk_path(manifest.tensors[0].chunks[0].hash) is not None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _mmap_call(addr: int | None, length: int, flags: int, fd: int) -> int:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _LIBC.mmap(addr, length, prot, flags, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return got


def map_chunks(store: Store, chunks: list[tuple[str, int]], dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``dtype`` over ``chunks`` (hash, size: every size but the last a
    whole number of pages) of a local store, mapped back to back (unverified)."""
    total = sum(size for _, size in chunks)
    files = [(store.local_chunk_path(h), size) for h, size in chunks]
    return torch.frombuffer(_map_files(files, total), dtype=dtype)  # NOTE: keeps the map alive


def _map_files(files: list[tuple[Path, int]], total: int) -> ctypes.Array:
    """Map ``files`` back to back into one private, copy-on-write range of ``total`` bytes."""
    length = -(-total // PAGE_SIZE) * PAGE_SIZE
    base = _mmap_call(None, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    try:
        offset = 0
        for path, size in files:
            _map_one(base + offset, path, size)
            offset += size
    except BaseException:
        _LIBC.munmap(base, length)
        raise
    _LIBC.madvise(base, length, _MADV_WILLNEED)
    array = (ctypes.c_ubyte * total).from_address(base)
    weakref.finalize(array, _LIBC.munmap, base, length)
    return array


def _map_one(addr: int, path: Path, size: int) -> None:
    try:
        fd = open_regular(path, path.parents[2].resolve())  # NOTE: root/chunks/xx/hash
    except FileNotFoundError:
        raise IntegrityError(f"chunk {path.name[:16]} is missing ({path})") from None
    try:
        actual = os.fstat(fd).st_size
        # NOTE: touching a mapped page past the end of its file raises SIGBUS; sizes are
        # checked before mapping, and chunk files are immutable once renamed into place.
        if actual != size:
            raise IntegrityError(
                f"chunk {path.name[:16]} is truncated or padded ({actual} bytes, manifest "
                f"says {size})"
            )
        if size:
            _mmap_call(addr, size, mmap.MAP_PRIVATE | _MAP_FIXED, fd)
    finally:
        os.close(fd)


def _mapped_tensor(store: Store, entry: TensorEntry):
    if entry.nbytes == 0:
        return _empty(entry), []
    files = [(store.local_chunk_path(c.hash), c.size) for c in entry.chunks]
    array = _map_files(files, entry.nbytes)
    flat = torch.frombuffer(array, dtype=dtype_from_name(entry.dtype))  # keeps `array` alive
    tensor = flat.view(entry.shape)
    raw = memoryview(array).cast("B")

    def task(offset: int, size: int, h: str) -> Callable[[], int]:
        def run() -> int:
            verify_chunk(raw[offset : offset + size], h, f"tensor {entry.name}")
            return size

        return run

    return tensor, [task(*span) for span in _spans(entry)]


# -- CUDA: pinned double buffers and a copy stream (untested here) ----------------------------
def _restore_cuda(
    store: Store,
    manifest: Manifest,
    device: torch.device,
    progress: Progress | None,
    workers: int,
) -> dict[str, torch.Tensor]:
    out = {e.name: _empty(e, device) for e in manifest.tensors}
    largest = max((c.size for e in manifest.tensors for c in e.chunks), default=0)
    if largest == 0:
        return out
    stream = torch.cuda.Stream(device)
    staging: queue.Queue = queue.Queue()
    for _ in range(2 * workers):  # two buffers per reader: read one while the other copies
        buf = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
        staging.put((buf, torch.cuda.Event()))

    def task(entry: TensorEntry, offset: int, size: int, h: str) -> None:
        buf, event = staging.get()
        try:
            event.synchronize()  # the previous copy out of this buffer is done
            view = memoryview(buf.numpy()).cast("B")[:size]
            store.read_chunk(h, view)
            verify_chunk(view, h, f"tensor {entry.name}")
            dest = _byte_view(out[entry.name])[offset : offset + size]
            with torch.cuda.stream(stream):
                dest.copy_(buf[:size], non_blocking=True)
                event.record(stream)
        finally:
            staging.put((buf, event))
        if progress:
            progress(size)

    with ThreadPoolExecutor(workers, thread_name_prefix="snapshot-h2d") as pool:
        _wait_all([pool.submit(task, e, *span) for e in manifest.tensors for span in _spans(e)])
    stream.synchronize()
    return out


# -- runtime files ----------------------------------------------------------------------------
def restore_files(store: Store, manifest: Manifest, group: str, dest: Path) -> int:
    """Write the image's files under ``group/`` into ``dest`` (verified; existing files are
    kept); returns how many were written."""
    written = 0
    for f in manifest.files:
        if not f.path.startswith(group + "/"):
            continue
        target = new_file_target(dest, f.path.removeprefix(group + "/"), f.path)
        if target is None:
            continue
        data = store.get_chunk(f.chunk.hash, f.chunk.size)
        verify_chunk(data, f.chunk.hash, f"file {f.path}")
        write_new_file(target, data)
        written += 1
    return written


def new_file_target(dest: Path, rel: str, what: str) -> Path | None:
    """``dest / rel`` for a plain relative path (else ``IntegrityError``), None if it exists
    (existing files are kept)."""
    if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts or "" in rel.split("/"):
        raise IntegrityError(f"file entry {what[:80]!r} is not a plain relative path")
    target = dest / rel
    return None if target.exists() else target


def write_new_file(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (a temporary name, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
