"""Process snapshots (tier P) in a snapshot store: the files of a ``runsc checkpoint`` image
dir, cut into content-addressed chunks, plus a JSON manifest under ``process-<key>``.

Published chunks first, each verified; the manifest last (so a crash leaves no visible half
image). Every chunk of a fetched image is verified before the restored process is started
(a file linked from a local store while ``runsc restore`` reads it: ``place``, ``verify``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from warmboot.snapshot.image import SnapshotError
from warmboot.snapshot.store_api import HASH_RE, discard_chunks

SCHEMA = 1
KIND = "warmboot-process-snapshot"
CHUNK_BYTES = 1 << 30
"""An image file up to this size is one chunk, which a fetch links rather than copies (an
image ``runsc_image`` rewrote is 3x runsc's: 346 MB on the demo model). A chunk is read into
memory whole only when it is published."""
PREFIX = "process-"
MAX_MAPPED_BYTES = 1 << 40


class ProcessImageError(SnapshotError):
    """No usable process image: missing, corrupt, or from another schema."""


def manifest_key(key: str) -> str:
    return PREFIX + key


def publish(store, key: str, image_dir: Path, meta: dict, progress=None) -> int:
    """Put every file of ``image_dir`` into ``store``; returns the bytes of new chunks. The
    chunks a failed publish wrote are removed again (nothing refers to them)."""
    files, new = [], []
    try:
        for path in sorted(p for p in image_dir.rglob("*") if p.is_file()):
            chunks = []
            with open(path, "rb") as f:
                while piece := f.read(CHUNK_BYTES):
                    h = hashlib.sha256(piece).hexdigest()
                    if store.put_chunk(h, piece):
                        new.append((h, len(piece)))
                    chunks.append({"sha256": h, "size": len(piece)})
                    if progress:
                        progress(len(piece))
            files.append({"name": path.relative_to(image_dir).as_posix(), "chunks": chunks})
        manifest = {"schema": SCHEMA, "kind": KIND, "key": key, "created": time.time(), **meta}
        manifest["files"] = files
        gone = [h for h in chunk_refs(manifest) if not store.has_chunk(h)]
        if gone:  # NOTE: an ``rm`` ran meanwhile (or the mapped tier-A image went away)
            raise ProcessImageError(
                f"{len(gone)} chunks vanished from {store.url} while publishing"
            )
        store.put_manifest(manifest_key(key), json.dumps(manifest, indent=1).encode())
    except BaseException:
        discard_chunks(store, [h for h, _ in new])
        raise
    return sum(n for _, n in new)


def lookup(store, key: str) -> dict | None:
    data = store.get_manifest(manifest_key(key))
    return None if data is None else parse(data)


def parse(data: bytes) -> dict:
    """A process manifest from its JSON; ``ProcessImageError`` if it is not one we can use
    (every chunk reference and file name checked for shape)."""
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested 100k deep
        raise ProcessImageError(f"process manifest is not JSON: {type(e).__name__}") from None
    if not isinstance(manifest, dict):
        raise ProcessImageError("process manifest is not a JSON object")
    if manifest.get("kind") != KIND or manifest.get("schema") != SCHEMA:
        raise ProcessImageError(
            f"process manifest schema {manifest.get('schema')!r} / kind "
            f"{manifest.get('kind')!r} is not {SCHEMA} / {KIND}"
        )
    files = manifest.get("files")
    if not isinstance(files, list) or not all(_is_file_entry(f) for f in files):
        raise ProcessImageError("process manifest has a malformed file list")
    mapped = manifest.get("mapped_chunks", {})
    if not isinstance(mapped, dict) or not all(_is_ref(h, n) for h, n in mapped.items()):
        raise ProcessImageError("process manifest has malformed mapped chunks")
    if not isinstance(manifest.get("canary"), list):
        raise ProcessImageError("process manifest records no canary")
    return manifest


def _is_ref(h: object, size: object, limit: int = MAX_MAPPED_BYTES) -> bool:
    """A SHA-256 name and a size in [0, limit] (an image's own chunks are at most
    ``CHUNK_BYTES``, what ``publish`` writes: a manifest cannot make a fetch reserve more)."""
    ok_size = type(size) is int and 0 <= size <= limit
    return isinstance(h, str) and HASH_RE.fullmatch(h) is not None and ok_size


def _is_file_entry(f: object) -> bool:
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        return False
    name, chunks = f["name"], f.get("chunks")
    if not name or name.startswith("/") or ".." in Path(name).parts or not isinstance(chunks, list):
        return False
    return all(
        isinstance(c, dict) and _is_ref(c.get("sha256"), c.get("size"), CHUNK_BYTES) for c in chunks
    )


def is_process_key(store_key: str) -> bool:
    """Whether a store's manifest key names a process image (not an engine image)."""
    return store_key.startswith(PREFIX)


def chunk_refs(manifest: dict) -> dict[str, int]:
    """hash -> size of every chunk the image uses: its files' and the tier-A chunks the
    checkpointed process maps (its weights), which no ``rm`` may collect while it exists."""
    refs = {c["sha256"]: c["size"] for f in manifest["files"] for c in f["chunks"]}
    return refs | dict(manifest.get("mapped_chunks", {}))


@dataclass(frozen=True)
class Linked:
    """An image file hard-linked from a local store, not yet verified."""

    path: Path
    chunk: dict
    name: str


def fetch(store, manifest: dict, image_dir: Path, progress=None) -> int:
    """Write the image files into ``image_dir``, every chunk verified; returns bytes."""
    total, linked = place(store, manifest, image_dir, progress)
    verify(linked, progress)
    return total


def place(store, manifest: dict, image_dir: Path, progress=None) -> tuple[int, list[Linked]]:
    """Write the image files into ``image_dir``: (bytes, the files hard-linked from a local
    store, still to be checked with ``verify``: runsc can restore meanwhile). A copied chunk
    is verified as it comes. The tier-A chunks the process maps must all be in the store."""
    gone = [h for h in manifest.get("mapped_chunks", {}) if not store.has_chunk(h)]
    if gone:
        raise ProcessImageError(
            f"{len(gone)} chunks of the weights it maps are gone from the store"
        )
    total, linked = 0, []
    for entry in manifest["files"]:
        dest = image_dir / entry["name"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        if _link(store, entry, dest):
            linked.append(Linked(dest, entry["chunks"][0], entry["name"]))
        else:
            _copy(store, entry, dest, progress)
        total += sum(c["size"] for c in entry["chunks"])
    return total, linked


def _link(store, entry: dict, dest: Path) -> bool:
    """A file of one chunk in a local store on this file system: hard-linked into place (no
    copy, no buffer of its size). The store is trusted as for the weights the process maps:
    a chunk file changed in place after ``verify`` would reach the restore."""
    chunk = entry["chunks"][0] if len(entry["chunks"]) == 1 else None
    path = chunk and store.local_chunk_path(chunk["sha256"])
    try:
        if not path or not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.link(path, dest, follow_symlinks=False)
    except OSError:  # NOTE: another file system, or no links allowed there: copy
        return False
    return True


def verify(linked: list[Linked], progress=None) -> None:
    """``ProcessImageError`` unless every linked file hashes to its chunk's name."""
    buf = bytearray(16 << 20)
    for file in linked:
        digest, size = hashlib.sha256(), 0
        with open(file.path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                digest.update(memoryview(buf)[:n])
                size += n
                if progress:  # NOTE: the store deadline watches it
                    progress(n)
        if digest.hexdigest() != file.chunk["sha256"] or size != file.chunk["size"]:
            raise _corrupt(file.chunk, file.name)


def _copy(store, entry: dict, dest: Path, progress) -> None:
    """Each chunk read straight into the file's pages and hashed there: no buffer of a
    chunk's size (up to ``CHUNK_BYTES``). The space is reserved first, so a full disk is an
    ``OSError``, not a fault on a mapped page."""
    total = sum(c["size"] for c in entry["chunks"])
    with open(dest, "w+b") as f:
        if total == 0:
            return
        os.posix_fallocate(f.fileno(), 0, total)
        with mmap.mmap(f.fileno(), total) as mapped, memoryview(mapped) as view:
            pos = 0
            for chunk in entry["chunks"]:
                with view[pos : pos + chunk["size"]] as part:
                    store.read_chunk(chunk["sha256"], part)
                    if hashlib.sha256(part).hexdigest() != chunk["sha256"]:
                        raise _corrupt(chunk, entry["name"])
                pos += chunk["size"]
                if progress:
                    progress(chunk["size"])


def _corrupt(chunk: dict, name: str) -> ProcessImageError:
    return ProcessImageError(f"chunk {chunk['sha256'][:16]} of {name} is corrupt")


def image_total(manifest: dict) -> int | None:
    """The image files' bytes, as the manifest says (None if it cannot)."""
    try:
        return sum(int(c["size"]) for f in manifest["files"] for c in f["chunks"])
    except (KeyError, TypeError, ValueError):
        return None


def prefetch_mapped(store, manifest: dict) -> threading.Thread | None:
    """Start reading the weights the restored process maps (its tier-A chunks, where the store
    has them on a local disk) into the page cache, once ``runsc restore`` runs: the disk is
    idle while runsc decompresses the image, and the worker's first pass over its weights
    (its first step) then reads memory, in the order the manifest lists them (the packed
    weights first: a decode step reads only those). 1.5B model, cold page cache: tier P's
    first token 8.9-9.3 -> 8.2-8.3 s. (Begun before runsc, it delays the launcher's own
    file reads.)"""
    paths = [store.local_chunk_path(h) for h in manifest.get("mapped_chunks", {})]
    if not paths or None in paths:
        return None
    thread = threading.Thread(target=_will_need, args=(paths,), name="prefetch", daemon=True)
    thread.start()
    return thread


def _will_need(paths: list[Path]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # NOTE: only a hint: the restore reports a chunk that is really gone
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def discard(store, key: str) -> None:
    """Drop a bad image's manifest (its chunks stay until ``snapshot rm`` / GC)."""
    store.delete_manifest(manifest_key(key))


def image_bytes(image_dir: Path) -> int:
    return sum(p.stat().st_size for p in image_dir.rglob("*") if p.is_file())
