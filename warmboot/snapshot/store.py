"""Snapshot stores: a local directory and any S3-compatible bucket, with one layout.

    <root>/chunks/<hash[:2]>/<hash>     raw chunk bytes, named by their SHA-256
    <root>/manifests/<key>.json         one manifest per compatibility key

Publishing is atomic: chunks first (each one's bytes are hashed by the store before they are
written), the manifest last. A local write goes to ``<root>/tmp`` and is renamed into place; an
S3 PUT carries the SHA-256 so the server rejects damaged uploads and an object appears whole or
not at all. A crash mid-way leaves unreferenced chunks, never a visible half snapshot; two
publishers of the same key write identical chunks and either's complete manifest wins.
"""

from __future__ import annotations

import base64
import os
import re
import stat
import tempfile
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from warmboot.snapshot.image import IntegrityError, SnapshotError, chunk_hash

STALE_TMP_SECONDS = 3600
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest larger than this is refused unread (a real one is tens of kilobytes)."""
_HASH = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[0-9A-Za-z_.-]{1,128}")


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


S3_RANGE_BYTES = 8 << 20


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

    def stored_bytes(self) -> int:
        """Bytes held in chunks (manifests excluded)."""
        return sum(self.list_chunks().values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalStore(Store):
    def __init__(self, root: str | Path, parallelism: int | None = None):
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        self.parallelism = parallelism or max(2, min(8, 2 * (os.cpu_count() or 1)))

    def _chunk_path(self, h: str) -> Path:
        if not isinstance(h, str) or not _HASH.fullmatch(h):
            raise IntegrityError(f"chunk name {str(h)[:80]!r} is not a SHA-256 hex digest")
        return self.root / "chunks" / h[:2] / h

    def _manifest_path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise SnapshotError(f"snapshot key {str(key)[:80]!r} is not a key")
        return self.root / "manifests" / f"{key}.json"

    def _write_atomic(self, path: Path, data: memoryview | bytes) -> None:
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def has_chunk(self, h: str) -> bool:
        return self._chunk_path(h).is_file()

    def put_chunk(self, h: str, data: memoryview | bytes) -> bool:
        if self.has_chunk(h):
            return False
        self._check(data, h)
        self._write_atomic(self._chunk_path(h), data)
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
        base = self.root / "chunks"
        if not base.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in base.glob("??/*") if p.is_file()}

    def delete_chunk(self, h: str) -> None:
        self._chunk_path(h).unlink(missing_ok=True)

    def put_manifest(self, key: str, data: bytes) -> None:
        self._write_atomic(self._manifest_path(key), data)

    def get_manifest(self, key: str) -> bytes | None:
        try:
            fd = open_regular(self._manifest_path(key), self.root)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"manifest {key} exceeds {MAX_MANIFEST_BYTES} bytes")
        return data

    def list_keys(self) -> list[str]:
        base = self.root / "manifests"
        if not base.is_dir():
            return []
        return sorted(p.stem for p in base.glob("*.json") if _KEY.fullmatch(p.stem))

    def delete_manifest(self, key: str) -> None:
        self._manifest_path(key).unlink(missing_ok=True)

    def remove_stale_tmp(self, older_than: float = STALE_TMP_SECONDS) -> int:
        """Delete temporary files left by crashed publishers; returns how many."""
        tmp_dir, now, n = self.root / "tmp", time.time(), 0
        for p in tmp_dir.glob("*") if tmp_dir.is_dir() else ():
            try:
                stale = now - p.stat().st_mtime > older_than
            except FileNotFoundError:  # NOTE: another publisher just renamed it into place
                continue
            if stale:
                p.unlink(missing_ok=True)
                n += 1
        return n


class S3Store(Store):
    """``s3://bucket/prefix`` on any S3-compatible endpoint (boto3).

    The endpoint, region and credentials come from the arguments or the usual variables
    (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, profiles). Chunks larger than
    ``S3_RANGE_BYTES`` are fetched as parallel ranged GETs.
    """

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        parallelism: int | None = None,
        client=None,
    ):
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise ValueError(f"an S3 store URL looks like s3://bucket/prefix, got {url!r}")
        self.url, self.bucket, self.prefix = url, bucket, prefix.strip("/")
        self.parallelism = parallelism or 8
        self.client = client or _s3_client(endpoint_url, region, 4 * self.parallelism)
        self._ranges = ThreadPoolExecutor(self.parallelism, thread_name_prefix="s3-range")

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _chunk_key(self, h: str) -> str:
        return self._key("chunks", h[:2], h)

    def _call(self, what: str, fn, **kw):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(kw.get("Key", "")) from None
            raise StoreError(f"{self.url}: {what} failed: {code}: {e}") from None
        except BotoCoreError as e:
            raise StoreError(f"{self.url}: {what} failed: {e}") from None

    def has_chunk(self, h: str) -> bool:
        try:
            self._call("HEAD chunk", self.client.head_object, Key=self._chunk_key(h))
        except FileNotFoundError:
            return False
        return True

    def put_chunk(self, h: str, data: memoryview | bytes) -> bool:
        if self.has_chunk(h):
            return False
        self._check(data, h)
        digest = base64.b64encode(bytes.fromhex(h)).decode()
        self._call(
            "PUT chunk",
            self.client.put_object,
            Key=self._chunk_key(h),
            Body=bytes(data),
            ChecksumSHA256=digest,
        )
        return True

    def read_chunk(self, h: str, out: memoryview) -> None:
        size = len(out)
        spans = [(o, min(S3_RANGE_BYTES, size - o)) for o in range(0, size, S3_RANGE_BYTES)]
        if len(spans) <= 1:
            self._read_range(h, out, 0, size, whole=True)
            return
        futures = [self._ranges.submit(self._read_range, h, out, o, n) for o, n in spans]
        for f in futures:
            f.result()

    def _read_range(self, h: str, out: memoryview, start: int, n: int, whole=False) -> None:
        key = self._chunk_key(h)
        try:
            resp = self._call(
                "GET chunk", self.client.get_object, Key=key, Range=f"bytes={start}-{start + n - 1}"
            )
        except FileNotFoundError:
            raise IntegrityError(f"chunk {h[:16]} is missing from {self.url}") from None
        total = int(resp["ContentRange"].rpartition("/")[2]) if "ContentRange" in resp else None
        data = resp["Body"].read()
        if len(data) != n or (total is not None and total != len(out)):
            raise IntegrityError(
                f"chunk {h[:16]} in {self.url} has the wrong size "
                f"(range {start}+{n} gave {len(data)} bytes, object {total} of {len(out)})"
            )
        out[start : start + n] = data

    def list_chunks(self) -> dict[str, int]:
        return {k.rpartition("/")[2]: s for k, s in self._list(self._key("chunks") + "/")}

    def _list(self, prefix: str) -> list[tuple[str, int]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        try:
            return [(o["Key"], o["Size"]) for page in pages for o in page.get("Contents", [])]
        except Exception as e:  # noqa: BLE001 - botocore raises many types
            raise StoreError(f"{self.url}: listing {prefix} failed: {e}") from None

    def delete_chunk(self, h: str) -> None:
        self._call("DELETE chunk", self.client.delete_object, Key=self._chunk_key(h))

    def put_manifest(self, key: str, data: bytes) -> None:
        digest = base64.b64encode(bytes.fromhex(chunk_hash(data))).decode()
        self._call(
            "PUT manifest",
            self.client.put_object,
            Key=self._key("manifests", f"{key}.json"),
            Body=data,
            ChecksumSHA256=digest,
        )

    def get_manifest(self, key: str) -> bytes | None:
        try:
            resp = self._call(
                "GET manifest", self.client.get_object, Key=self._key("manifests", f"{key}.json")
            )
        except FileNotFoundError:
            return None
        return resp["Body"].read()

    def list_keys(self) -> list[str]:
        names = [k.rpartition("/")[2] for k, _ in self._list(self._key("manifests") + "/")]
        return sorted(n.removesuffix(".json") for n in names if n.endswith(".json"))

    def delete_manifest(self, key: str) -> None:
        self._call(
            "DELETE manifest", self.client.delete_object, Key=self._key("manifests", f"{key}.json")
        )


def _s3_client(endpoint_url: str | None, region: str | None, pool: int):
    import boto3
    from botocore.config import Config

    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
    config = Config(
        max_pool_connections=pool,
        retries={"max_attempts": 3, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config
    )


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
