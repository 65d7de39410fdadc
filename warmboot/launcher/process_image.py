"""Process snapshots (tier P) in a snapshot store: the files of a ``runsc checkpoint`` image
dir, cut into content-addressed chunks, plus a JSON manifest under ``process-<key>``.

Published chunks first, each verified; the manifest last (so a crash leaves no visible half
image). Fetching verifies every chunk before the image is used.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from warmboot.snapshot.image import SnapshotError

SCHEMA = 1
KIND = "warmboot-process-snapshot"
CHUNK_BYTES = 64 << 20
PREFIX = "process-"


class ProcessImageError(SnapshotError):
    """No usable process image: missing, corrupt, or from another schema."""


def manifest_key(key: str) -> str:
    return PREFIX + key


def publish(store, key: str, image_dir: Path, meta: dict) -> int:
    """Put every file of ``image_dir`` into ``store``; returns the bytes of new chunks."""
    files, new_bytes = [], 0
    for path in sorted(p for p in image_dir.rglob("*") if p.is_file()):
        chunks = []
        with open(path, "rb") as f:
            while piece := f.read(CHUNK_BYTES):
                h = hashlib.sha256(piece).hexdigest()
                if store.put_chunk(h, piece):
                    new_bytes += len(piece)
                chunks.append({"sha256": h, "size": len(piece)})
        files.append({"name": path.relative_to(image_dir).as_posix(), "chunks": chunks})
    manifest = {"schema": SCHEMA, "kind": KIND, "key": key, "created": time.time(), **meta}
    manifest["files"] = files
    store.put_manifest(manifest_key(key), json.dumps(manifest, indent=1).encode())
    return new_bytes


def lookup(store, key: str) -> dict | None:
    data = store.get_manifest(manifest_key(key))
    return None if data is None else parse(data)


def parse(data: bytes) -> dict:
    """A process manifest from its JSON; ``ProcessImageError`` if it is not one we can use."""
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
    return manifest


def is_process_key(store_key: str) -> bool:
    """Whether a store's manifest key names a process image (not an engine image)."""
    return store_key.startswith(PREFIX)


def chunk_refs(manifest: dict) -> dict[str, int]:
    """hash -> size of every chunk the image uses."""
    return {c["sha256"]: c["size"] for f in manifest["files"] for c in f["chunks"]}


def fetch(store, manifest: dict, image_dir: Path) -> int:
    """Write the image files into ``image_dir`` (verifying every chunk); returns bytes."""
    total = 0
    for entry in manifest["files"]:
        name = entry["name"]
        if name.startswith("/") or ".." in Path(name).parts:
            raise ProcessImageError(f"unsafe file name {name!r} in the process manifest")
        dest = image_dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            for chunk in entry["chunks"]:
                buf = bytearray(chunk["size"])
                store.read_chunk(chunk["sha256"], memoryview(buf))
                if hashlib.sha256(buf).hexdigest() != chunk["sha256"]:
                    raise ProcessImageError(f"chunk {chunk['sha256'][:16]} of {name} is corrupt")
                f.write(buf)
                total += len(buf)
    return total


def discard(store, key: str) -> None:
    """Drop a bad image's manifest (its chunks stay until ``snapshot rm`` / GC)."""
    store.delete_manifest(manifest_key(key))


def image_bytes(image_dir: Path) -> int:
    return sum(p.stat().st_size for p in image_dir.rglob("*") if p.is_file())
