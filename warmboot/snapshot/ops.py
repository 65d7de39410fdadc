"""Store-level operations on whole snapshots: find, copy between stores, verify, remove."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from warmboot.snapshot import process_image
from warmboot.snapshot.image import IntegrityError, Manifest, SnapshotError, verify_chunk
from warmboot.snapshot.store import Store

Progress = Callable[[int], None]


def resolve_keys(store: Store, prefix: str | None) -> list[str]:
    """All keys (``prefix`` None) or the one key starting with ``prefix``."""
    keys = store.list_keys()
    if prefix is None:
        return keys
    hits = [k for k in keys if k.startswith(prefix)]
    if not hits:
        raise SnapshotError(f"no snapshot {prefix!r} in {store.url}")
    if len(hits) > 1:
        raise SnapshotError(f"{prefix!r} is ambiguous in {store.url}: {', '.join(hits)}")
    return hits


def manifest_refs(store: Store, key: str) -> tuple[dict[str, int], bytes]:
    """(hash -> size of every chunk, the manifest's bytes) of an engine or a process image."""
    data = store.get_manifest(key)
    if data is None:
        raise SnapshotError(f"no snapshot {key} in {store.url}")
    if process_image.is_process_key(key):
        return process_image.chunk_refs(process_image.parse(data)), data
    return Manifest.from_json(data, where=f"snapshot {key} in {store.url}").chunk_refs(), data


def load_manifest(store: Store, key: str) -> Manifest:
    data = store.get_manifest(key)
    if data is None:
        raise SnapshotError(f"no snapshot {key} in {store.url}")
    return Manifest.from_json(data, where=f"snapshot {key} in {store.url}")


def copy_snapshot(src: Store, dst: Store, key: str, progress: Progress | None = None) -> int:
    """Copy one snapshot, moving only the chunks ``dst`` lacks (each verified on the way);
    the manifest is written last. Returns the chunk bytes moved."""
    refs, manifest = manifest_refs(src, key)

    def move(h: str, size: int) -> int:
        if dst.has_chunk(h):  # each check is progress too: a long scan is no stall
            if progress:
                progress(0)
            return 0
        data = src.get_chunk(h, size)
        verify_chunk(data, h, f"snapshot {key}")
        dst.put_chunk(h, data)
        if progress:
            progress(size)
        return size

    with ThreadPoolExecutor(max(src.parallelism, dst.parallelism)) as pool:
        moved = sum(pool.map(lambda item: move(*item), refs.items()))
    dst.put_manifest(key, manifest)
    return moved


def verify_snapshot(store: Store, key: str, progress: Progress | None = None) -> Manifest | None:
    """Read and hash every chunk of a snapshot; raise ``IntegrityError`` naming bad chunks.
    Returns an engine image's manifest (None for a process image)."""
    refs, _ = manifest_refs(store, key)

    def check(h: str, size: int) -> str | None:
        try:
            verify_chunk(store.get_chunk(h, size), h, f"snapshot {key}")
        except IntegrityError as e:
            return str(e)
        finally:
            if progress:
                progress(size)
        return None

    with ThreadPoolExecutor(store.parallelism) as pool:
        errors = [e for e in pool.map(lambda i: check(*i), refs.items()) if e]
    if errors:
        raise IntegrityError(f"{len(errors)} bad chunks: " + "; ".join(errors[:5]))
    return None if process_image.is_process_key(key) else load_manifest(store, key)


def remove_snapshot(store: Store, key: str) -> int:
    """Delete a manifest, then the chunks no remaining manifest references; returns bytes freed
    (none are collected while another manifest cannot be read).

    NOTE: a publisher of the same weights running at the same moment re-checks its chunks
    before writing its manifest, so it fails cleanly rather than publishing a hole."""
    store.delete_manifest(key)
    live: set[str] = set()
    for other in store.list_keys():
        try:
            live |= set(manifest_refs(store, other)[0])
        except SnapshotError:
            return 0  # NOTE: an unreadable manifest (a newer schema) may use any chunk: keep all
    freed = 0
    for h, size in store.list_chunks().items():
        if h not in live:
            store.delete_chunk(h)
            freed += size
    return freed
