"""``s3://bucket/prefix`` on any S3-compatible endpoint (boto3), with the store layout."""

from __future__ import annotations

import base64
import os
from concurrent.futures import ThreadPoolExecutor

from warmboot.snapshot.image import IntegrityError, chunk_hash
from warmboot.snapshot.store_api import MAX_LEASE_BYTES, MAX_RECORD_BYTES, Store, StoreError

S3_RANGE_BYTES = 8 << 20
S3_CONNECT_TIMEOUT_S = 5.0
S3_READ_TIMEOUT_S = 10.0


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

    def _get(self, what: str, key: str, limit: int | None = None) -> bytes | None:
        """Object ``key``'s bytes (at most ``limit``), or None where there is none."""
        try:
            resp = self._call(f"GET {what}", self.client.get_object, Key=key)
        except FileNotFoundError:
            return None
        return resp["Body"].read(limit)

    def get_manifest(self, key: str) -> bytes | None:
        return self._get("manifest", self._key("manifests", f"{key}.json"))

    def list_keys(self) -> list[str]:
        names = [k.rpartition("/")[2] for k, _ in self._list(self._key("manifests") + "/")]
        return sorted(n.removesuffix(".json") for n in names if n.endswith(".json"))

    def delete_manifest(self, key: str) -> None:
        self._call(
            "DELETE manifest", self.client.delete_object, Key=self._key("manifests", f"{key}.json")
        )

    def put_record(self, name: str, data: bytes) -> None:
        self._call(
            "PUT record",
            self.client.put_object,
            Key=self._key("records", f"{name}.json"),
            Body=data,
        )

    def get_record(self, name: str) -> bytes | None:
        data = self._get("record", self._key("records", f"{name}.json"), MAX_RECORD_BYTES + 1)
        return data if data is not None and len(data) <= MAX_RECORD_BYTES else None

    def _lease_key(self, name: str) -> str:
        return self._key("leases", f"{name}.lease")

    def create_lease(self, name: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``): the server lets only one writer create it."""
        try:
            self._call(
                "PUT lease",
                self.client.put_object,
                Key=self._lease_key(name),
                Body=data,
                IfNoneMatch="*",
            )
        except StoreError as e:
            if "PreconditionFailed" in str(e) or "ConditionalRequestConflict" in str(e):
                return False
            raise
        # NOTE: a server that ignores the condition lets the last writer win: read it back
        return self.get_lease(name) == data

    def get_lease(self, name: str) -> bytes | None:
        return self._get("lease", self._lease_key(name), MAX_LEASE_BYTES)

    def delete_lease(self, name: str) -> None:
        self._call("DELETE lease", self.client.delete_object, Key=self._lease_key(name))


def _s3_client(endpoint_url: str | None, region: str | None, pool: int):
    import boto3
    from botocore.config import Config

    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
    config = Config(  # NOTE: bounded waits; a stalled endpoint fails a call, never hangs it
        connect_timeout=S3_CONNECT_TIMEOUT_S,
        read_timeout=S3_READ_TIMEOUT_S,
        max_pool_connections=pool,
        retries={"max_attempts": 3, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config
    )
