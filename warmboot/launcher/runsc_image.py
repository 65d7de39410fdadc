"""Rewrite a ``runsc checkpoint`` image so that ``runsc restore`` inflates less of it.

This runsc (Debian's 2022-12-19 release) saves the process's memory as 1 MiB chunks, each
deflated at best speed, and its restore inflates every chunk before the process runs: on
the demo model 538 MB from 120 MB, most of the restore's 2.0 s. Deflate also has stored
blocks, which the same reader only copies. ``unpack`` rewrites each chunk that deflate
shrinks less than ``STORE_RATIO`` into stored blocks and keeps the rest (mostly zero bytes,
cheap to inflate) as they are. Demo, cold page cache, 5 rounds: the image 116 -> 346 MB,
``runsc restore`` 2.06 -> 1.44 s, tier P's first token 2.90 -> 2.35 s (all chunks stored:
532 MB, 2.54 s; the reads and the image's hashing then cost what the inflating saved).

The layout (gVisor's ``statefile`` and ``compressio``), of which only the chunks change:
``"gVisorSF"`` | metadata length (8 bytes, big-endian) | metadata JSON | HMAC-SHA256 of all
that (this runsc writes it always, keyed with nothing) | chunk size (4 bytes) | per chunk:
its length (4 bytes) and raw deflate data, to the end of the file. Any other layout (a
keyed HMAC, hashed chunks, a newer runsc's ``"compression": "none"``) is left as it is.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("warmboot.startup")
MAGIC = b"gVisorSF"
STORE_RATIO = 0.2
"""A chunk that deflates to more than this share of its size is stored (inflating it costs
time for every byte it saves); one that deflates better stays deflated."""
MAX_METADATA = 16 << 20  # NOTE: gVisor's own limit
MAX_CHUNK = 64 << 20
_WBITS = -15  # NOTE: raw deflate, no zlib header


class ImageLayoutError(ValueError):
    """The image is not in the layout ``unpack`` knows; it is left as it is."""


@dataclass(frozen=True)
class Unpacked:
    before: int
    """Bytes of the image as runsc wrote it."""
    after: int
    """Bytes of the rewritten image."""
    chunks: int
    stored: int
    """Chunks now in stored blocks (the others stay deflated)."""


def unpack(path: Path, store_ratio: float = STORE_RATIO) -> Unpacked:
    """Rewrite the image at ``path`` in place (through a temporary file beside it: on any
    error it is unchanged). ``ImageLayoutError`` when its layout is not the one above."""
    path = Path(path)
    tmp = path.with_name(path.name + ".unpacking")
    chunks = stored = 0
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            head, chunk_size = _head(src)
            dst.write(head)
            for raw, deflated in _chunks(src, chunk_size):
                chunks += 1
                if len(deflated) > store_ratio * len(raw):
                    deflated, stored = _stored(raw), stored + 1
                dst.write(len(deflated).to_bytes(4, "big") + deflated)
        before = path.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Unpacked(before, path.stat().st_size, chunks, stored)


def chunk_kinds(path: Path) -> tuple[int, int]:
    """(stored, deflated): how the image's chunks are written (a chunk is stored when its
    first deflate block is)."""
    stored = deflated = 0
    with open(path, "rb") as src:
        _, chunk_size = _head(src)
        for _, data in _chunks(src, chunk_size):
            if data[0] >> 1 & 3 == 0:  # NOTE: BTYPE 00: stored
                stored += 1
            else:
                deflated += 1
    return stored, deflated


def _head(src: BinaryIO) -> tuple[bytes, int]:
    """Everything before the first chunk, and the chunk size."""
    magic, size = src.read(8), src.read(8)
    if magic != MAGIC or len(size) < 8:
        raise ImageLayoutError("not a gVisor state file")
    n = int.from_bytes(size, "big")
    if n > MAX_METADATA:
        raise ImageLayoutError(f"metadata of {n} bytes")
    meta_bytes = src.read(n)
    try:
        meta = json.loads(meta_bytes)
    except ValueError:
        raise ImageLayoutError("its metadata is not JSON") from None
    if not isinstance(meta, dict) or meta.get("compression", "flate-best-speed") != (
        "flate-best-speed"
    ):
        raise ImageLayoutError(f"its memory is not deflated ({str(meta)[:80]})")
    head = magic + size + meta_bytes
    mac = src.read(32)
    if mac != hmac.new(b"", head, hashlib.sha256).digest():
        raise ImageLayoutError("its metadata is not followed by this runsc's unkeyed HMAC")
    size_bytes = src.read(4)
    chunk_size = int.from_bytes(size_bytes, "big")
    if len(size_bytes) < 4 or not 0 < chunk_size <= MAX_CHUNK:
        raise ImageLayoutError(f"chunk size {chunk_size}")
    return head + mac + size_bytes, chunk_size


def _chunks(src: BinaryIO, chunk_size: int):
    """(inflated, deflated) of every chunk to the end of the file; only the last may be
    short, and each must be one whole deflate stream."""
    last = False
    while length := src.read(4):
        n = int.from_bytes(length, "big")
        if n > 2 * chunk_size:  # NOTE: deflate grows incompressible data by a few bytes only
            raise ImageLayoutError(f"a chunk of {n} bytes deflated")
        data = src.read(n)
        if last or len(length) < 4 or len(data) < n or n == 0:
            raise ImageLayoutError("its chunks do not run to the end of the file")
        raw = _inflate(data, chunk_size)
        last = len(raw) < chunk_size
        yield raw, data


def _inflate(data: bytes, chunk_size: int) -> bytes:
    inflater = zlib.decompressobj(_WBITS)
    try:
        raw = inflater.decompress(data, chunk_size + 1)
    except zlib.error as e:
        raise ImageLayoutError(f"a chunk does not inflate: {e}") from None
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail or not raw:
        raise ImageLayoutError("a chunk is not one deflate stream of at most the chunk size")
    if len(raw) > chunk_size:
        raise ImageLayoutError("a chunk inflates past the chunk size")
    return raw


def _stored(raw: bytes) -> bytes:
    """``raw`` as deflate stored blocks (level 0)."""
    deflater = zlib.compressobj(0, zlib.DEFLATED, _WBITS)
    return deflater.compress(raw) + deflater.flush()


def unpack_or_keep(path: Path) -> Unpacked | None:
    """``unpack``, logged; an image it cannot rewrite is restored as runsc wrote it."""
    try:
        done = unpack(path)
    except (ImageLayoutError, OSError) as e:
        log.warning("process image left as runsc wrote it: %s", e)
        return None
    log.info(
        "process image: %d of %d chunks stored, %.0f -> %.0f MB (a restore inflates less)",
        done.stored,
        done.chunks,
        done.before / 1e6,
        done.after / 1e6,
    )
    return done
