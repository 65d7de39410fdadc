"""Snapshot stores: a local directory and any S3-compatible bucket, with one layout.

    <root>/chunks/<hash[:2]>/<hash>     raw chunk bytes, named by their SHA-256
    <root>/manifests/<key>.json         one manifest per compatibility key
    <root>/records/<name>.json          small records hosts share (start costs)

Publishing is atomic: chunks first (each one's bytes are hashed by the store before they are
written), the manifest last. A local write goes to ``<root>/tmp`` and is renamed into place; an
S3 PUT carries the SHA-256 so the server rejects damaged uploads and an object appears whole or
not at all. A crash mid-way leaves unreferenced chunks, never a visible half snapshot; two
publishers of the same key write identical chunks and either's complete manifest wins.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from warmboot.snapshot.image import IntegrityError, SnapshotError
from warmboot.snapshot.s3_store import S3Store
from warmboot.snapshot.store_api import (
    HASH_RE,
    KEY_RE,
    MAX_LEASE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    STALE_TMP_SECONDS,
    Store,
    StoreError,
    open_regular,
)

__all__ = ["LocalStore", "S3Store", "Store", "StoreError", "open_regular", "open_store"]


class LocalStore(Store):
    def __init__(self, root: str | Path, parallelism: int | None = None):
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        self.parallelism = parallelism or max(2, min(8, 2 * (os.cpu_count() or 1)))

    def _chunk_path(self, h: str) -> Path:
        if not isinstance(h, str) or not HASH_RE.fullmatch(h):
            raise IntegrityError(f"chunk name {str(h)[:80]!r} is not a SHA-256 hex digest")
        return self.root / "chunks" / h[:2] / h

    def _manifest_path(self, key: str) -> Path:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise SnapshotError(f"snapshot key {str(key)[:80]!r} is not a key")
        return self.root / "manifests" / f"{key}.json"

    def _dir(self, *parts: str, create: bool = False) -> int:
        """A directory fd of ``root/parts``: every component must be a real directory, never
        a link (a ``tmp/`` or ``chunks/xx/`` linking outside the store is refused, so nothing
        is ever written or deleted there). The caller closes it."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    raise
                except OSError as e:  # ELOOP / ENOTDIR: a link or a file
                    where = "/".join(parts[: i + 1])
                    raise StoreError(
                        f"{self.url}: {where} is not a plain directory of the store ({e.strerror})"
                    ) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_atomic(self, parts: tuple[str, ...], name: str, data: memoryview | bytes) -> None:
        """Write ``root/parts/name`` via ``root/tmp`` and a rename, through directory fds."""
        tmp_fd = self._dir("tmp", create=True)
        try:
            dst_fd = self._dir(*parts, create=True)
            try:
                _write_and_rename(tmp_fd, dst_fd, name, data)
            finally:
                os.close(dst_fd)
        finally:
            os.close(tmp_fd)

    def _unlink(self, parts: tuple[str, ...], name: str) -> None:
        try:
            fd = self._dir(*parts)
        except FileNotFoundError:
            return
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def has_chunk(self, h: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._chunk_path(h)).st_mode)
        except OSError:
            return False

    def put_chunk(self, h: str, data: memoryview | bytes) -> bool:
        if self.has_chunk(h):
            return False
        self._check(data, h)
        self._write_atomic(("chunks", h[:2]), h, data)
        return True

    def read_chunk(self, h: str, out: memoryview) -> None:
        try:
            f = os.fdopen(open_regular(self._chunk_path(h), self.root), "rb", buffering=0)
        except FileNotFoundError:
            raise IntegrityError(f"chunk {h[:16]} is missing from {self.url}") from None
        with f:
            done = 0
            while done < len(out):
                n = f.readinto(out[done:])
                if not n:
                    raise IntegrityError(
                        f"chunk {h[:16]} in {self.url} is truncated ({done} of {len(out)} bytes)"
                    )
                done += n
            if f.read(1):
                raise IntegrityError(f"chunk {h[:16]} in {self.url} is longer than recorded")

    def local_chunk_path(self, h: str) -> Path | None:
        return self._chunk_path(h)

    def list_chunks(self) -> dict[str, int]:
        """Regular files named by their hash in plain ``chunks/xx`` directories (links and
        anything else are not the store's and are skipped)."""
        try:
            base = self._dir("chunks")
        except (FileNotFoundError, StoreError):
            return {}
        out: dict[str, int] = {}
        try:
            for sub in os.listdir(base):
                out |= _chunk_files(base, sub)
        finally:
            os.close(base)
        return out

    def delete_chunk(self, h: str) -> None:
        self._chunk_path(h)  # NOTE: checks the name's shape
        self._unlink(("chunks", h[:2]), h)

    def put_manifest(self, key: str, data: bytes) -> None:
        self._write_atomic(("manifests",), self._manifest_path(key).name, data)

    def _read(self, path: Path, limit: int) -> bytes | None:
        """At most ``limit`` bytes of store file ``path`` (``open_regular``), or None."""
        try:
            fd = open_regular(path, self.root)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(limit)

    def get_manifest(self, key: str) -> bytes | None:
        data = self._read(self._manifest_path(key), MAX_MANIFEST_BYTES + 1)
        if data is not None and len(data) > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"manifest {key} exceeds {MAX_MANIFEST_BYTES} bytes")
        return data

    def list_keys(self) -> list[str]:
        base = self.root / "manifests"
        if not base.is_dir():
            return []
        return sorted(p.stem for p in base.glob("*.json") if KEY_RE.fullmatch(p.stem))

    def delete_manifest(self, key: str) -> None:
        self._unlink(("manifests",), self._manifest_path(key).name)

    def put_record(self, name: str, data: bytes) -> None:
        self._write_atomic(("records",), self._manifest_path(name).name, data)

    def get_record(self, name: str) -> bytes | None:
        path = self.root / "records" / self._manifest_path(name).name  # NOTE: checks the name
        data = self._read(path, MAX_RECORD_BYTES + 1)
        return data if data is not None and len(data) <= MAX_RECORD_BYTES else None

    def _lease_name(self, name: str) -> str:
        return self._manifest_path(name).with_suffix(".lease").name  # NOTE: checks the name

    def create_lease(self, name: str, data: bytes) -> bool:
        """A hard link from a written temporary file: it appears whole, and only once."""
        lease = self._lease_name(name)
        tmp_fd = self._dir("tmp", create=True)
        try:
            lease_fd = self._dir("leases", create=True)
            try:
                return _write_and_link(tmp_fd, lease_fd, lease, data)
            finally:
                os.close(lease_fd)
        finally:
            os.close(tmp_fd)

    def get_lease(self, name: str) -> bytes | None:
        return self._read(self.root / "leases" / self._lease_name(name), MAX_LEASE_BYTES)

    def delete_lease(self, name: str) -> None:
        self._unlink(("leases",), self._lease_name(name))

    def remove_stale_tmp(self, older_than: float = STALE_TMP_SECONDS) -> int:
        """Delete temporary files left by crashed publishers; returns how many. Only entries
        of the store's own ``tmp/`` are touched, never what a link points to."""
        try:
            fd = self._dir("tmp")
        except (FileNotFoundError, StoreError):
            return 0
        now, n = time.time(), 0
        try:
            for name in os.listdir(fd):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode) and now - st.st_mtime > older_than:
                        os.unlink(name, dir_fd=fd)
                        n += 1
                except FileNotFoundError:  # NOTE: another publisher just renamed it into place
                    continue
        finally:
            os.close(fd)
        return n


def _write_and_rename(tmp_fd: int, dst_fd: int, name: str, data: memoryview | bytes) -> None:
    tmp = f"{os.getpid()}-{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o644, dir_fd=tmp_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=dst_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=tmp_fd)
        raise


def _write_and_link(tmp_fd: int, dst_fd: int, name: str, data: bytes) -> bool:
    tmp = f"{os.getpid()}-{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o644, dir_fd=tmp_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=tmp_fd)


def _chunk_files(base_fd: int, sub: str) -> dict[str, int]:
    try:
        fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=base_fd)
    except OSError:
        return {}
    out = {}
    try:
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if HASH_RE.fullmatch(name) and name.startswith(sub) and stat.S_ISREG(st.st_mode):
                out[name] = st.st_size
    finally:
        os.close(fd)
    return out


def default_store_dir() -> Path:
    from warmboot.config import cache_root

    return cache_root() / "snapshots"


def open_store(url: str | os.PathLike | Store | None = None, **options) -> Store:
    """``s3://bucket/prefix`` -> ``S3Store``; a path or ``file://path`` -> ``LocalStore``;
    None -> the default local store (``$WARMBOOT_CACHE/snapshots`` or
    ``~/.cache/warmboot/snapshots``)."""
    if isinstance(url, Store):
        return url
    if url is None:
        return LocalStore(default_store_dir(), **options)
    url = os.fspath(url)
    if url.startswith("s3://"):
        return S3Store(url, **options)
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"unsupported snapshot store {url!r}; use a path or s3://bucket/prefix")
    return LocalStore(url.removeprefix("file://"), **options)
