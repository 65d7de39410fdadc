"""Write a snapshot image: tensors and runtime files as content-addressed chunks (in parallel,
skipping chunks the store already holds), then the manifest, last."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from warmboot.snapshot.image import (
    CHUNK_BYTES,
    ChunkRef,
    FileEntry,
    IntegrityError,
    Manifest,
    TensorEntry,
    chunk_hash,
    dtype_name,
    split,
    tensor_bytes,
)
from warmboot.snapshot.store import LocalStore, Store
from warmboot.snapshot.store_api import discard_chunks

Progress = Callable[[int], None]
RUNTIME_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
MAX_CACHE_DIR_BYTES = 256 << 20


def runtime_files(model_dir: Path, device: torch.device) -> dict[str, Path]:
    """Relative image path -> file: the model's tokenizer/config files and, on CUDA, the
    Triton kernel cache (the CPU runs no compiled Triton kernels)."""
    files = {f"model/{n}": model_dir / n for n in RUNTIME_FILES if (model_dir / n).is_file()}
    cache = triton_cache_dir()
    if device.type == "cuda" and cache.is_dir():
        found = {p: p.stat().st_size for p in cache.rglob("*") if p.is_file()}
        if sum(found.values()) <= MAX_CACHE_DIR_BYTES:
            files |= {f"triton_cache/{p.relative_to(cache).as_posix()}": p for p in found}
    return files


def triton_cache_dir() -> Path:
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def publish_image(
    store: Store,
    key: str,
    fields: dict[str, str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    files: Mapping[str, Path | bytes] | None = None,
    facts: dict[str, Any] | None = None,
    progress: Progress | None = None,
    chunk_bytes: int | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[Manifest, int]:
    """Publish an image under ``key``; returns the manifest and the chunk bytes newly written."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if isinstance(store, LocalStore):
        store.remove_stale_tmp()  # left by publishers that crashed long ago
    writer = _ChunkWriter(store, progress)
    try:
        manifest = _write_all(writer, key, fields, tensors, files, facts, chunk_bytes, extra)
        store.put_manifest(key, manifest.to_json())
    except BaseException:
        _discard_unpublished(store, key, writer.new)  # NOTE: a failed publish leaves nothing
        raise
    return manifest, writer.written


def _discard_unpublished(store: Store, key: str, hashes: list[str]) -> None:
    try:
        if store.get_manifest(key) is not None:
            return  # NOTE: the manifest PUT failed late (a timeout) yet landed: keep its chunks
    except Exception:  # noqa: BLE001 - cannot tell: keep the chunks (GC collects orphans)
        return
    discard_chunks(store, hashes)


def _write_all(writer, key, fields, tensors, files, facts, chunk_bytes, extra) -> Manifest:
    store = writer.store
    try:
        pending = [_put_tensor(writer, n, t, chunk_bytes) for n, t in tensors]
        pending_files = [(p, writer.put(_file_bytes(src))) for p, src in (files or {}).items()]
        writer.drain()
    finally:
        writer.close()
    entries = [TensorEntry(n, d, s, tuple(r.ref() for r in refs)) for n, d, s, refs in pending]
    manifest = Manifest(
        key=key,
        fields=dict(fields),
        tensors=tuple(entries),
        files=tuple(FileEntry(p, r.ref()) for p, r in pending_files),
        facts=dict(facts or {}),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        chunk_bytes=chunk_bytes,
        extra=dict(extra or {}),
    )
    # NOTE: a concurrent ``rm`` may have collected a chunk we found present; check before
    # the manifest makes the snapshot visible.
    missing = [h for h in manifest.chunk_refs() if not store.has_chunk(h)]
    if missing:
        raise IntegrityError(f"{len(missing)} chunks vanished from {store.url} while publishing")
    return manifest


def _file_bytes(src: Path | bytes) -> bytes:
    return src if isinstance(src, bytes) else Path(src).read_bytes()


def _put_tensor(writer: _ChunkWriter, name: str, t: torch.Tensor, chunk_bytes: int):
    host = t.detach().to("cpu").contiguous()
    data = tensor_bytes(host)
    refs = [writer.put(data[o : o + n], keep=host) for o, n in split(len(data), chunk_bytes)]
    return name, dtype_name(t.dtype), tuple(t.shape), refs


class _LazyRef:
    """A chunk reference whose hash is computed by a worker thread."""

    def __init__(self, size: int):
        self.size = size
        self.hash = ""

    def ref(self) -> ChunkRef:
        assert self.hash, "chunk not hashed yet"
        return ChunkRef(self.hash, self.size)


class _ChunkWriter:
    """Hash and store chunks on a thread pool, with a bounded number in flight."""

    def __init__(self, store: Store, progress: Progress | None):
        self.store, self.progress = store, progress
        self.pool = ThreadPoolExecutor(store.parallelism, thread_name_prefix="snapshot-put")
        self.pending: deque[Future] = deque()
        self.written = 0
        self.new: list[str] = []
        """Chunks this publish wrote (not found in the store)."""
        self.claimed: set[str] = set()
        self.lock = threading.Lock()

    def put(self, data: memoryview | bytes, keep: object = None) -> _LazyRef:
        """Queue a chunk; ``keep`` holds the tensor that owns ``data`` alive until written."""
        ref = _LazyRef(len(data))
        while len(self.pending) >= 2 * self.store.parallelism:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._put, ref, data, keep))
        return ref

    def _put(self, ref: _LazyRef, data: memoryview | bytes, keep: object) -> None:
        ref.hash = chunk_hash(data)
        with self.lock:  # NOTE: equal chunks in one publish are put (and counted) once
            first = ref.hash not in self.claimed
            self.claimed.add(ref.hash)
        if first and self.store.put_chunk(ref.hash, data):
            with self.lock:
                self.written += len(data)
                self.new.append(ref.hash)
        if self.progress:
            self.progress(len(data))

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
