"""The snapshot image format: a versioned JSON manifest naming content-addressed chunks.

A chunk is raw bytes named by its SHA-256 (hex). A tensor is stored as its bytes after every
load-time transform (fused projections, dtype conversion), split into pieces of ``CHUNK_BYTES``
(a multiple of the page size, so every piece starts page-aligned inside the tensor and a chunk
file can be memory-mapped straight into place). Runtime files (tokenizer, config, compile
caches) are one chunk each. Nothing is pickled: JSON, raw bytes and hashes only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: torch is imported where it is used: the launcher reads stores
    import torch  # without paying for it

SCHEMA_VERSION = 1
PAGE_SIZE = 4096
CHUNK_BYTES = 64 << 20
HASH_NAME = "sha256"
assert CHUNK_BYTES % PAGE_SIZE == 0

_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


class SnapshotError(RuntimeError):
    """A snapshot cannot be used; the message names the problem."""


class SchemaError(SnapshotError):
    """The manifest is malformed or from a newer schema."""


class IntegrityError(SnapshotError):
    """A chunk is missing, truncated or does not match its hash."""


class KeyMismatchError(SnapshotError):
    """The snapshot was made for another model, engine setting or software stack."""


def chunk_hash(data: memoryview | bytes) -> str:
    """Hex SHA-256 of ``data`` (hashlib releases the GIL, so threads hash in parallel)."""
    return hashlib.sha256(data).hexdigest()


def verify_chunk(data: memoryview | bytes, expected: str, what: str) -> None:
    """Raise ``IntegrityError`` unless ``data`` hashes to ``expected``."""
    actual = chunk_hash(data)
    if actual != expected:
        raise IntegrityError(
            f"{what}: chunk {expected[:16]} is corrupt (its bytes hash to {actual[:16]})"
        )


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPE_NAMES:
        raise SchemaError(f"unsupported tensor dtype {name!r} in the manifest")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def split(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, size) of each piece of an ``nbytes`` tensor; offsets are page-aligned."""
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


@dataclass(frozen=True)
class ChunkRef:
    hash: str
    size: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    """In order; piece i covers bytes [i * CHUNK_BYTES, i * CHUNK_BYTES + size)."""

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self.chunks)

    def expected_nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class FileEntry:
    path: str
    """Relative path; the first component names the group (``model/``, ``triton_cache/``)."""
    chunk: ChunkRef


@dataclass(frozen=True)
class Manifest:
    key: str
    fields: dict[str, str]
    """The compatibility key's fields (``key.key_fields``); ``key`` is their digest."""
    tensors: tuple[TensorEntry, ...]
    files: tuple[FileEntry, ...]
    facts: dict[str, Any]
    """Recorded at the cold boot: RuntimeFacts, warm-up canary tokens, start-up phase times."""
    created: str
    chunk_bytes: int = CHUNK_BYTES
    schema: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def chunk_refs(self) -> dict[str, int]:
        """Every distinct chunk the snapshot needs: hash -> size."""
        refs = {c.hash: c.size for t in self.tensors for c in t.chunks}
        refs.update({f.chunk.hash: f.chunk.size for f in self.files})
        return refs

    def to_json(self) -> bytes:
        doc = {
            "schema": self.schema,
            "key": self.key,
            "created": self.created,
            "hash": HASH_NAME,
            "page_size": PAGE_SIZE,
            "chunk_bytes": self.chunk_bytes,
            "fields": self.fields,
            "facts": self.facts,
            "extra": self.extra,
            "tensors": [_tensor_doc(t) for t in self.tensors],
            "files": [{"path": f.path, **_chunk_doc(f.chunk)} for f in self.files],
        }
        return json.dumps(doc, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # nested 100k deep
            raise SchemaError(f"{where} is not valid JSON: {type(e).__name__}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("schema"), int):
            raise SchemaError(f"{where} has no integer 'schema' field")
        if doc["schema"] > SCHEMA_VERSION:
            raise SchemaError(
                f"{where} uses snapshot schema {doc['schema']}, newer than this warmboot "
                f"understands ({SCHEMA_VERSION}); upgrade warmboot or recreate the snapshot"
            )
        if doc.get("hash", HASH_NAME) != HASH_NAME:
            raise SchemaError(f"{where} uses hash {doc['hash']!r}; only {HASH_NAME} is supported")
        try:
            return cls._parse(doc)
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"{where} is malformed: {type(e).__name__}: {e}") from None

    @classmethod
    def _parse(cls, doc: dict) -> Manifest:
        tensors = tuple(
            TensorEntry(
                name=t["name"],
                dtype=t["dtype"],
                shape=tuple(int(s) for s in t["shape"]),
                chunks=tuple(_chunk(c) for c in t["chunks"]),
            )
            for t in doc["tensors"]
        )
        for t in tensors:
            if t.nbytes != t.expected_nbytes():
                raise ValueError(f"tensor {t.name}: chunks hold {t.nbytes} bytes, shape needs more")
        files = tuple(FileEntry(f["path"], _chunk(f)) for f in doc["files"])
        return cls(
            key=str(doc["key"]),
            fields={str(k): str(v) for k, v in doc["fields"].items()},
            tensors=tensors,
            files=files,
            facts=dict(doc.get("facts", {})),
            created=str(doc.get("created", "")),
            chunk_bytes=int(doc.get("chunk_bytes", CHUNK_BYTES)),
            schema=int(doc["schema"]),
            extra=dict(doc.get("extra", {})),
        )


def _chunk(d: dict) -> ChunkRef:
    h, size = str(d["hash"]), int(d["size"])
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h) or size < 0:
        raise ValueError(f"bad chunk reference {d!r}")
    return ChunkRef(h, size)


def _chunk_doc(c: ChunkRef) -> dict:
    return {"hash": c.hash, "size": c.size}


def _tensor_doc(t: TensorEntry) -> dict:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "nbytes": t.nbytes,
        "chunks": [_chunk_doc(c) for c in t.chunks],
    }
