"""What every snapshot store offers (``Store``), and the rules for reading a local one."""

from __future__ import annotations

import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from warmboot.snapshot.image import IntegrityError, SnapshotError, chunk_hash

STALE_TMP_SECONDS = 3600
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest larger than this is refused unread (a real one is tens of kilobytes)."""
MAX_LEASE_BYTES = 4096
MAX_RECORD_BYTES = 1 << 20
"""A record larger than this is read as none (``Store.get_record``)."""
HASH_RE = re.compile(r"[0-9a-f]{64}")
KEY_RE = re.compile(r"[0-9A-Za-z_.-]{1,128}")


def open_regular(path: Path, within: Path) -> int:
    """A read-only fd of ``path``, which must be a regular file inside ``within``: the last
    component is not followed if it is a link, a FIFO or device never blocks the open, and a
    directory on the way that links outside the store is refused. The caller closes it."""
    if not path.resolve().is_relative_to(within):
        raise IntegrityError(f"{path} leads outside the store {within}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink
        raise IntegrityError(f"{path} cannot be opened as a store file: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path} is not a regular file")
    return fd


class StoreError(SnapshotError):
    """The store cannot be reached or written."""


class Store(ABC):
    url: str
    parallelism: int = 4

    def _check(self, data: memoryview | bytes, expected: str) -> None:
        if chunk_hash(data) != expected:
            raise IntegrityError(f"refusing to publish chunk {expected[:16]}: bytes do not match")

    @abstractmethod
    def has_chunk(self, h: str) -> bool: ...

    @abstractmethod
    def put_chunk(self, h: str, data: memoryview | bytes) -> bool:
        """Verify ``data`` hashes to ``h`` and store it; False if it was already there."""

    @abstractmethod
    def read_chunk(self, h: str, out: memoryview) -> None:
        """Fill ``out`` (exactly the chunk's size) with the chunk's bytes (unverified)."""

    def get_chunk(self, h: str, size: int) -> bytes:
        buf = bytearray(size)
        self.read_chunk(h, memoryview(buf))
        return bytes(buf)

    def local_chunk_path(self, h: str) -> Path | None:
        """A file holding the chunk, for memory-mapping; None when the store is remote."""
        return None

    @abstractmethod
    def list_chunks(self) -> dict[str, int]: ...

    @abstractmethod
    def delete_chunk(self, h: str) -> None: ...

    @abstractmethod
    def put_manifest(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_manifest(self, key: str) -> bytes | None: ...

    @abstractmethod
    def list_keys(self) -> list[str]: ...

    @abstractmethod
    def delete_manifest(self, key: str) -> None: ...

    @abstractmethod
    def create_lease(self, name: str, data: bytes) -> bool:
        """Write lease ``name`` only if it does not exist (atomically); False if it does."""

    @abstractmethod
    def get_lease(self, name: str) -> bytes | None: ...

    @abstractmethod
    def delete_lease(self, name: str) -> None: ...

    @abstractmethod
    def put_record(self, name: str, data: bytes) -> None:
        """Write small record ``name`` whole (the last writer wins): figures the hosts that
        share this store keep in it (``start_costs``)."""

    @abstractmethod
    def get_record(self, name: str) -> bytes | None:
        """Record ``name``'s bytes (data, never trusted), or None."""

    def stored_bytes(self) -> int:
        """Bytes held in chunks (manifests excluded)."""
        return sum(self.list_chunks().values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def discard_chunks(store: Store, hashes: Iterable[str]) -> None:
    """Best-effort removal of chunks a failed publish wrote (no manifest refers to them; a
    concurrent publisher that counted on one fails its pre-manifest check cleanly)."""
    for h in hashes:
        try:
            store.delete_chunk(h)
        except Exception:  # noqa: BLE001 - a read-only or vanished store: GC collects them later
            return
