"""Snapshot image, key and local store without an engine: round trips through both CPU restore
paths, schema and integrity errors, dedup on bytes stored, concurrent and crashed publishers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from warmboot.snapshot.image import (
    PAGE_SIZE,
    IntegrityError,
    Manifest,
    SchemaError,
    SnapshotError,
)
from warmboot.snapshot.key import diff_fields, key_digest, key_fields
from warmboot.snapshot.ops import copy_snapshot, remove_snapshot, verify_snapshot
from warmboot.snapshot.publish import publish_image
from warmboot.snapshot.restore import restore_tensors
from warmboot.snapshot.store import LocalStore, open_store

SMALL_CHUNK = 4 * PAGE_SIZE
FIELDS = {"model_files": "abc", "engine.dtype": "float32"}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(97, 301, generator=g),  # 116 KB: 8 chunks, the last one partial
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "ones_a": torch.ones(50),
        "ones_b": torch.ones(50),  # same bytes as ones_a: one chunk
        "ints": torch.arange(12, dtype=torch.int64).view(3, 4),
        "empty": torch.empty(0, 5),
    }


def publish(store, key="k1", ts=None, fields=FIELDS, **kw):
    ts = tensors() if ts is None else ts
    files = {"model/config.json": b'{"a": 1}'}
    return publish_image(
        store, key, fields, ts.items(), files, {"n": 1}, chunk_bytes=SMALL_CHUNK, **kw
    )


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def largest_chunk(store: LocalStore, manifest: Manifest) -> Path:
    entry = max(manifest.tensors, key=lambda t: t.chunks[0].size if t.chunks else 0)
    return store.local_chunk_path(entry.chunks[0].hash)


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "read"])
def test_round_trip_bitwise(store, use_mmap):
    manifest, _ = publish(store)
    assert Manifest.from_json(store.get_manifest("k1")) == manifest
    assert len(manifest.tensors[0].chunks) == 8
    out = restore_tensors(store, manifest, "cpu", use_mmap=use_mmap)
    for name, t in tensors().items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name
    assert out["big"].data_ptr() % PAGE_SIZE == 0 or not use_mmap


def test_mapped_tensor_outlives_store_files(store):
    """Chunk files are immutable once published: a mapping stays valid after ``rm``."""
    manifest, _ = publish(store)
    out = restore_tensors(store, manifest, "cpu")
    remove_snapshot(store, "k1")
    assert store.list_chunks() == {}
    assert torch.equal(out["big"], tensors()["big"])


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "read"])
def test_restore_fault_is_named(store, use_mmap):
    manifest, _ = publish(store)
    path = largest_chunk(store, manifest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupt"):
        restore_tensors(store, manifest, "cpu", use_mmap=use_mmap)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(IntegrityError, match="truncated"):
        restore_tensors(store, manifest, "cpu", use_mmap=use_mmap)
    path.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        restore_tensors(store, manifest, "cpu", use_mmap=use_mmap)
    with pytest.raises(IntegrityError, match="1 bad chunks"):
        verify_snapshot(store, "k1")


def test_newer_schema_is_refused():
    doc = json.loads(Manifest("k", {}, (), (), {}, "now").to_json())
    doc["schema"] = 99
    with pytest.raises(SchemaError, match="schema 99, newer than this warmboot"):
        Manifest.from_json(json.dumps(doc).encode())
    with pytest.raises(SchemaError, match="not valid JSON"):
        Manifest.from_json(b"{half")


def test_store_refuses_chunk_whose_bytes_do_not_match(store):
    with pytest.raises(IntegrityError, match="do not match"):
        store.put_chunk("0" * 64, b"hello")
    assert store.list_chunks() == {}


def test_dedup_second_snapshot_adds_only_differing_bytes(store):
    _, first = publish(store, "k1")
    assert first == store.stored_bytes()
    before = store.stored_bytes()
    _, again = publish(store, "k2", fields=FIELDS | {"engine.block_size": "8"})
    assert again == 0 and store.stored_bytes() == before
    changed = tensors()
    changed["ints"] = changed["ints"] + 1
    _, written = publish(store, "k3", ts=changed)
    assert written == changed["ints"].numel() * 8
    assert store.stored_bytes() == before + written
    # rm frees only what no other snapshot uses
    assert remove_snapshot(store, "k3") == written
    assert remove_snapshot(store, "k2") == 0
    assert store.list_keys() == ["k1"]


def test_copy_moves_only_missing_chunks(store, tmp_path):
    publish(store, "k1")
    dst = open_store(tmp_path / "dst")
    moved = copy_snapshot(store, dst, "k1")
    assert moved == store.stored_bytes() == dst.stored_bytes()
    changed = tensors()
    changed["ints"] = changed["ints"] * 3
    publish(store, "k2", ts=changed)
    assert copy_snapshot(store, dst, "k2") == changed["ints"].numel() * 8
    assert dst.list_keys() == ["k1", "k2"]
    verify_snapshot(dst, "k2")


def test_a_long_presence_scan_is_no_stall(store, tmp_path):
    """Checking which chunks the destination holds reports progress: a copy onto a slow
    store (CI: a process image pushed to S3) is not abandoned while it only checks."""
    import time

    from warmboot.snapshot.deadline import run_with_deadline

    class SlowDst(LocalStore):
        def has_chunk(self, h: str) -> bool:
            time.sleep(0.05)
            return super().has_chunk(h)

    publish(store, "k1")
    dst = SlowDst(tmp_path / "dst", parallelism=1)
    copy_snapshot(store, dst, "k1")
    n_chunks = len(list((store.root / "chunks").rglob("*")))
    assert n_chunks * 0.05 > 0.3, "the scan must outlast the stall limit below"
    step = lambda progress: copy_snapshot(store, dst, "k1", progress)  # noqa: E731
    assert run_with_deadline("copy", step, stall_s=0.3) == 0


def test_concurrent_publishers_of_one_key(store, tmp_path):
    errors = []

    def run(i: int) -> None:
        try:
            publish(LocalStore(store.root), "same")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.list_keys() == ["same"]
    manifest = verify_snapshot(store, "same")
    assert torch.equal(restore_tensors(store, manifest)["big"], tensors()["big"])
    assert not list((store.root / "tmp").iterdir())


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from warmboot.snapshot.store import LocalStore
    from warmboot.snapshot.publish import publish_image
    calls = []
    real = LocalStore.put_chunk
    def put_then_die(self, h, data):
        calls.append(h)
        if len(calls) == 3:
            os._exit(9)  # a crash: no cleanup, no exception handlers
        return real(self, h, data)
    LocalStore.put_chunk = put_then_die
    ts = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    publish_image(LocalStore(sys.argv[1], parallelism=1), "k", {}, ts.items(), chunk_bytes=4096)
    """
)


def test_crash_during_publish_leaves_no_snapshot(tmp_path):
    root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(root)], cwd=Path.cwd())
    assert proc.returncode == 9
    store = LocalStore(root)
    assert store.list_keys() == []
    assert len(store.list_chunks()) == 2  # written before the crash; unreferenced
    with pytest.raises(SnapshotError, match="no snapshot"):
        verify_snapshot(store, "k")


def test_key_fields_name_differences(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    big = tmp_path / "model.safetensors"
    big.write_bytes(b"\0" * (17 << 20))
    settings = {"dtype": "float32", "block_size": 16}
    a = key_fields(tmp_path, settings, torch.device("cpu"))
    assert {"model_files", "engine.dtype", "torch", "python", "device.cpu_flags"} <= set(a)
    b = key_fields(tmp_path, settings | {"block_size": 8}, torch.device("cpu"))
    assert key_digest(a) != key_digest(b)
    (diff,) = diff_fields(b, a)
    assert diff.startswith("engine.block_size: 8 (this engine) != 16")
    with open(big, "r+b") as f:  # a weight change inside the sampled first MiB
        f.seek(1000)
        f.write(b"\1")
    assert key_fields(tmp_path, settings, torch.device("cpu"))["model_files"] != a["model_files"]


def test_publish_removes_stale_temporary_files(store):
    tmp = store.root / "tmp"
    tmp.mkdir(parents=True)
    stale, fresh = tmp / "123-stale", tmp / "456-fresh"
    stale.write_bytes(b"half a chunk")
    fresh.write_bytes(b"another publisher's chunk in flight")
    os.utime(stale, (0, 0))
    publish(store)
    assert not stale.exists() and fresh.exists()


def test_process_images_share_the_store_operations(store, tmp_path):
    """A process image (tier P) next to an engine image: ls-level operations understand it,
    verify and copy it, and garbage collection neither blocks on it nor frees its chunks."""
    from warmboot.snapshot import process_image

    publish(store, "k1")
    engine_bytes = store.stored_bytes()
    image = tmp_path / "image"
    image.mkdir()
    (image / "checkpoint.img").write_bytes(os.urandom(3000))
    process_image.publish(store, "p1", image, {"canary": [[1, -0.5]]})
    key = process_image.manifest_key("p1")
    assert verify_snapshot(store, key) is None
    dst = LocalStore(tmp_path / "dst")
    assert copy_snapshot(store, dst, key) == 3000
    assert process_image.lookup(dst, "p1")["canary"] == [[1, -0.5]]
    assert remove_snapshot(store, "k1") == engine_bytes, "a process manifest must not block GC"
    assert store.stored_bytes() == 3000, "the process image keeps its chunks"
    assert remove_snapshot(store, key) == 3000


def test_the_weights_a_process_image_maps_are_read_ahead(store, tmp_path, monkeypatch):
    """The tier-A chunks a restored process maps are read into the page cache in the
    background (the launcher starts it while ``runsc restore`` runs); a chunk gone from a
    local store is skipped (the restore reports it), and a remote store is left alone."""
    from warmboot.snapshot import process_image

    weights = {}
    for size in (1000, 2000):
        data = os.urandom(size)
        h = hashlib.sha256(data).hexdigest()
        store.put_chunk(h, data)
        weights[h] = size
    image = tmp_path / "image"
    image.mkdir()
    (image / "checkpoint.img").write_bytes(os.urandom(3000))
    process_image.publish(store, "p1", image, {"canary": [], "mapped_chunks": weights})
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, *a: advised.append((os.fstat(fd).st_size, *a)) or real(fd, *a),
    )
    manifest = process_image.lookup(store, "p1")
    process_image.prefetch_mapped(store, manifest).join(10)
    will_need = os.POSIX_FADV_WILLNEED
    assert sorted(advised) == [(1000, 0, 0, will_need), (2000, 0, 0, will_need)]

    advised.clear()
    store.local_chunk_path(next(iter(weights))).unlink()
    process_image.prefetch_mapped(store, manifest).join(10)
    assert advised == [(2000, 0, 0, will_need)]
    monkeypatch.setattr(store, "local_chunk_path", lambda h: None)
    assert process_image.prefetch_mapped(store, manifest) is None


def test_a_fetched_process_image_is_linked_when_it_can_be(store, tmp_path, monkeypatch):
    """A one-chunk image file is hard-linked from a local store (no copy), then verified; a
    file of several chunks, or a store without local files, is copied; a corrupt chunk is
    refused either way."""
    from warmboot.snapshot import process_image

    image = tmp_path / "image"
    image.mkdir()
    data = os.urandom(20000)
    (image / "checkpoint.img").write_bytes(data)
    process_image.publish(store, "one", image, {"canary": []})
    one = process_image.lookup(store, "one")
    monkeypatch.setattr(process_image, "CHUNK_BYTES", 8192)
    process_image.publish(store, "three", image, {"canary": []})
    three = process_image.lookup(store, "three")
    assert [len(m["files"][0]["chunks"]) for m in (one, three)] == [1, 3]

    for name, manifest, links in (("a", one, 2), ("b", three, 1)):
        assert process_image.fetch(store, manifest, tmp_path / name) == len(data)
        got = tmp_path / name / "checkpoint.img"
        assert got.read_bytes() == data and got.stat().st_nlink == links, name
    monkeypatch.setattr(store, "local_chunk_path", lambda h: None)
    process_image.fetch(store, one, tmp_path / "c")
    assert (tmp_path / "c" / "checkpoint.img").stat().st_nlink == 1, "copied"

    monkeypatch.undo()
    chunk = store.local_chunk_path(one["files"][0]["chunks"][0]["sha256"])
    chunk.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(process_image.ProcessImageError, match="corrupt"):
        process_image.fetch(store, one, tmp_path / "d")
    with monkeypatch.context() as m:  # NOTE: copied, it is hashed in the file it went to
        m.setattr(store, "local_chunk_path", lambda h: None)
        with pytest.raises(process_image.ProcessImageError, match="corrupt"):
            process_image.fetch(store, one, tmp_path / "d2")
    # NOTE: placed, a linked file is checked apart (the launcher: while runsc restores it)
    nbytes, linked = process_image.place(store, one, tmp_path / "e")
    assert nbytes == len(data) and [f.path for f in linked] == [tmp_path / "e/checkpoint.img"]
    with pytest.raises(process_image.ProcessImageError, match="corrupt"):
        process_image.verify(linked)
