"""The S3 store against a real S3-protocol server (moto's server mode on 127.0.0.1, a free
port): engine publish and restore, parallel ranged reads, push/pull, faults, racing publishers."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from tests.test_snapshot_engine import ENGINE_ARGS, outputs
from warmboot import LLM
from warmboot.snapshot import publish as publish_mod
from warmboot.snapshot import s3_store as s3_mod
from warmboot.snapshot.image import IntegrityError
from warmboot.snapshot.ops import copy_snapshot, verify_snapshot
from warmboot.snapshot.publish import publish_image
from warmboot.snapshot.restore import restore_tensors
from warmboot.snapshot.store import LocalStore, S3Store, open_store

pytest.importorskip("moto")
BUCKET = "snaps"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def s3(s3_endpoint, request) -> S3Store:
    """A fresh prefix per test; chunk objects above 4 KiB are read as parallel ranges."""
    mp = pytest.MonkeyPatch()
    mp.setattr(s3_mod, "S3_RANGE_BYTES", 4096)
    yield open_store(f"s3://{BUCKET}/{request.node.name}")
    mp.undo()


@pytest.fixture(scope="module")
def cold(path):
    return outputs(LLM(str(path), **ENGINE_ARGS))


def make_llm(path, store, **kw) -> LLM:
    return LLM(str(path), **(ENGINE_ARGS | kw), snapshot_store=store)


def test_engine_publishes_and_restores_through_s3(path, s3, cold, monkeypatch):
    monkeypatch.setattr(publish_mod, "CHUNK_BYTES", 16 << 10)
    first = make_llm(path, s3.url)
    assert first.engine.start_info.path == "cold"
    assert s3.list_keys() == [first.engine.snapshot.key]
    reads = []
    real = S3Store._read_range
    monkeypatch.setattr(
        S3Store, "_read_range", lambda self, *a, **k: reads.append(a[2]) or real(self, *a, **k)
    )
    second = make_llm(path, s3.url)
    assert second.engine.start_info.path == "restored_image", second.engine.start_info.reason
    assert max(reads) > 0, "big chunks were read as several ranges"
    assert outputs(second) == cold


def test_push_then_pull_moves_only_missing_chunks(path, s3, tmp_path):
    local = LocalStore(tmp_path / "local")
    make_llm(path, str(local.root))
    (key,) = local.list_keys()
    total = local.stored_bytes()
    assert copy_snapshot(local, s3, key) == total
    assert copy_snapshot(local, s3, key) == 0
    assert s3.stored_bytes() == total
    other = LocalStore(tmp_path / "other")
    assert copy_snapshot(s3, other, key) == total
    verify_snapshot(other, key)
    llm = make_llm(path, str(other.root))
    assert llm.engine.start_info.path == "restored_image"


def test_corrupt_object_and_vanishing_store_fall_back_to_cold(path, s3, cold, monkeypatch):
    make_llm(path, s3.url)
    (key,) = s3.list_keys()
    chunks = s3.list_chunks()
    # NOTE: a weight's chunk: the image also carries files a restore may not need to read
    # (the native kernels' library, where this host has it built already)
    tensors = json.loads(s3.get_manifest(key))["tensors"]
    victim = max((c["hash"] for t in tensors for c in t["chunks"]), key=chunks.get)
    s3.client.put_object(Bucket=s3.bucket, Key=s3._chunk_key(victim), Body=b"x" * chunks[victim])
    llm = make_llm(path, s3.url, snapshot_publish=False)
    assert llm.engine.start_info.path == "cold"
    assert "is corrupt" in llm.engine.start_info.reason
    # the bucket is emptied while the restore is reading
    s3.delete_chunk(victim)
    real, calls = S3Store.read_chunk, []

    def read_then_vanish(self, h, out):
        calls.append(h)
        if len(calls) == 1:
            for other in self.list_chunks():
                self.delete_chunk(other)
        return real(self, h, out)

    monkeypatch.setattr(S3Store, "read_chunk", read_then_vanish)
    llm = make_llm(path, s3.url, snapshot_publish=False)
    assert llm.engine.start_info.path == "cold"
    assert "missing" in llm.engine.start_info.reason
    assert outputs(llm) == cold


def test_racing_publishers_of_one_key(s3):
    ts = {f"t{i}": torch.full((3000,), float(i)) for i in range(6)}
    errors = []

    def run() -> None:
        try:
            store = open_store(s3.url)
            publish_image(store, "same", {"f": "1"}, ts.items(), chunk_bytes=4096)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    manifest = verify_snapshot(s3, "same")
    out = restore_tensors(s3, manifest)
    assert all(torch.equal(out[n], t) for n, t in ts.items())


def test_store_refuses_bytes_that_do_not_match_their_hash(s3):
    """Checked before the PUT; the PUT also carries ChecksumSHA256, which real S3 verifies
    (moto does not)."""
    with pytest.raises(IntegrityError, match="do not match"):
        s3.put_chunk("0" * 64, b"payload")
    assert s3.list_chunks() == {}


def test_records_round_trip(s3):
    """Hosts share small records (``start_costs``) through the bucket too."""
    assert s3.get_record("start-costs-x") is None
    s3.put_record("start-costs-x", b'{"k": {"cold": [1.0]}}')
    assert s3.get_record("start-costs-x") == b'{"k": {"cold": [1.0]}}'
    assert s3.list_keys() == [], "a record is no snapshot"
