"""The engine with a snapshot store: a restored engine equals a cold one bitwise, and every
injected fault ends in a cold boot (reason named) whose tokens match the cold reference."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.engine import startup as startup_mod
from warmboot.kernels import native
from warmboot.snapshot import publish as publish_mod
from warmboot.snapshot.image import (
    IntegrityError,
    Manifest,
    SnapshotError,
    chunk_hash,
    tensor_bytes,
)
from warmboot.snapshot.store import LocalStore

ENGINE_ARGS = dict(max_model_len=128, block_size=4, num_kv_blocks=64)
PROMPTS = random_prompts([5, 17, 9], VOCAB_SIZE, seed=7)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_llm(path, store=None, **kw) -> LLM:
    return LLM(str(path), **(ENGINE_ARGS | kw), snapshot_store=store and str(store))


def outputs(llm: LLM) -> list:
    """Greedy tokens and top-5 logprobs (floats compared exactly) of every prompt."""
    outs = llm.generate(PROMPTS, PARAMS)
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.fixture(scope="module")
def golden(path, tmp_path_factory):
    """A store holding one snapshot of the tiny llama (16 KiB chunks: multi-chunk tensors),
    and the cold engine's outputs."""
    root = tmp_path_factory.mktemp("golden") / "store"
    mp = pytest.MonkeyPatch()
    mp.setattr(publish_mod, "CHUNK_BYTES", 16 << 10)
    cold = make_llm(path, root)
    mp.undo()
    assert cold.engine.start_info.path == "cold"
    assert "no snapshot for key" in cold.engine.start_info.reason
    (key,) = LocalStore(root).list_keys()
    return root, key, outputs(cold), dict(cold.engine.runner.model.named_parameters())


@pytest.fixture
def store(golden, tmp_path):
    """A private copy of the golden store to damage."""
    root = tmp_path / "store"
    shutil.copytree(golden[0], root)
    return LocalStore(root)


def manifest_of(store: LocalStore, key: str) -> Manifest:
    return Manifest.from_json(store.get_manifest(key))


def embed(store: LocalStore, key: str):
    """The manifest entry of the embedding (several chunks)."""
    (entry,) = [t for t in manifest_of(store, key).tensors if t.name == "embed_tokens.weight"]
    return entry


def assert_cold_fallback(path, store, golden, reason: str) -> LLM:
    llm = make_llm(path, store.root, snapshot_publish=False)
    info = llm.engine.start_info
    assert info.path == "cold", info
    assert reason in info.reason, info.reason
    assert outputs(llm) == golden[2]
    return llm


def test_restored_engine_is_bitwise_equal(path, golden):
    llm = make_llm(path, golden[0])
    info = llm.engine.start_info
    assert info.path == "restored_image", info.reason
    assert golden[1] in info.reason
    assert "restore_weights" in info.phase_times and "load_weights" not in info.phase_times
    params = dict(llm.engine.runner.model.named_parameters())
    assert params.keys() == golden[3].keys()
    for name, p in params.items():
        assert torch.equal(p, golden[3][name]), name
    assert len(embed(LocalStore(golden[0]), golden[1]).chunks) > 1, (
        "precondition: a tensor mapped from several chunk files"
    )
    assert outputs(llm) == golden[2]


def test_a_publisher_runs_its_canary_on_the_kernels_a_restore_has(path, tmp_path, monkeypatch):
    """While the native library's first build runs, steps attend with SDPA (``native.ready``);
    a restore places the snapshot's library first. So a half-precision publishing boot waits
    for the build before its warm-up: its recorded canary comes from the kernels a restore
    runs."""
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    built, seen, real_library, real_canary = [], [], native.library, startup_mod.run_canary
    monkeypatch.setattr(native, "ready", lambda: bool(built))  # NOTE: a build in progress
    monkeypatch.setattr(native, "library", lambda: built.append(1) or real_library())
    monkeypatch.setattr(
        startup_mod, "run_canary", lambda engine: seen.append(native.ready()) or real_canary(engine)
    )
    cold = make_llm(path, tmp_path / "store", dtype="bfloat16")
    phases = list(cold.engine.start_info.phase_times)
    assert seen == [True] and phases.index("native_build") < phases.index("warmup")
    restored = make_llm(path, tmp_path / "store", dtype="bfloat16")
    assert restored.engine.start_info.path == "restored_image"
    assert "native_build" not in restored.engine.start_info.phase_times
    seen.clear()
    built.clear()
    make_llm(path, tmp_path / "fp32-store")  # NOTE: float32: torch's kernels are within the
    assert seen == [False], "canary's tolerance, and a first build is not waited for"


def test_flipped_byte_in_a_chunk(path, golden, store):
    chunk = store.local_chunk_path(embed(store, golden[1]).chunks[-1].hash)
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    assert_cold_fallback(path, store, golden, "is corrupt")


def test_truncated_chunk(path, golden, store):
    chunk = store.local_chunk_path(embed(store, golden[1]).chunks[1].hash)
    chunk.write_bytes(chunk.read_bytes()[:-1])
    assert_cold_fallback(path, store, golden, "truncated")


def test_missing_chunk(path, golden, store):
    entry = manifest_of(store, golden[1]).tensors[-1]
    store.local_chunk_path(entry.chunks[0].hash).unlink()
    assert_cold_fallback(path, store, golden, "missing")


def test_newer_schema(path, golden, store):
    doc = json.loads(store.get_manifest(golden[1]))
    doc["schema"] = 2
    store.put_manifest(golden[1], json.dumps(doc).encode())
    assert_cold_fallback(path, store, golden, "schema 2, newer than this warmboot")


def test_key_mismatch_names_the_field(path, golden, store):
    doc = json.loads(store.get_manifest(golden[1]))
    doc["fields"]["torch"] = "1.0.0"
    store.put_manifest(golden[1], json.dumps(doc).encode())
    assert_cold_fallback(path, store, golden, f"torch: {torch.__version__} (this engine) != 1.0.0")


def test_other_settings_name_the_closest_snapshot(path, golden, store):
    llm = make_llm(path, store.root, block_size=8, snapshot_publish=False)
    assert llm.engine.start_info.path == "cold"
    assert "engine.block_size: 8 (this engine) != 4 (snapshot)" in llm.engine.start_info.reason


def test_store_vanishes_mid_restore(path, golden, store, monkeypatch):
    real, calls = LocalStore.read_chunk, []

    def read_then_vanish(self, h, out):
        calls.append(h)
        if len(calls) == 2:
            shutil.rmtree(store.root, ignore_errors=True)
        return real(self, h, out)

    monkeypatch.setattr(LocalStore, "read_chunk", read_then_vanish)
    assert_cold_fallback(path, store, golden, "missing")
    assert len(calls) >= 2


def test_consistent_but_wrong_weights_fail_the_canary(path, golden, store):
    """A manifest re-hashed over other weights passes every hash; the warm-up canary catches it."""
    doc = json.loads(store.get_manifest(golden[1]))
    (lm_head,) = [t for t in doc["tensors"] if t["name"] == "lm_head.weight"]
    chunk = store.local_chunk_path(lm_head["chunks"][0]["hash"]).read_bytes()
    weights = torch.frombuffer(bytearray(chunk), dtype=torch.float32)
    poisoned = tensor_bytes(weights * 1.5).tobytes()  # sharper logits, same argmax
    lm_head["chunks"][0] = {"hash": chunk_hash(poisoned), "size": len(poisoned)}
    store.put_chunk(chunk_hash(poisoned), poisoned)
    store.put_manifest(golden[1], json.dumps(doc).encode())
    llm = assert_cold_fallback(path, store, golden, "canary")
    assert "load_weights" in llm.engine.start_info.phase_times


def test_crash_during_publish_then_cold_boot_publishes(path, golden, tmp_path, monkeypatch):
    root = tmp_path / "crashing"
    real, calls = LocalStore.put_chunk, []

    def put_then_fail(self, h, data):
        calls.append(h)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(self, h, data)

    monkeypatch.setattr(LocalStore, "put_chunk", put_then_fail)
    first = make_llm(path, root)
    assert first.engine.start_info.path == "cold"
    assert LocalStore(root).list_keys() == []  # chunks only: no visible snapshot
    assert outputs(first) == golden[2]
    monkeypatch.setattr(LocalStore, "put_chunk", real)
    second = make_llm(path, root)
    assert second.engine.start_info.path == "cold"
    third = make_llm(path, root)
    assert third.engine.start_info.path == "restored_image"
    assert outputs(third) == golden[2]


def test_the_snapshot_carries_the_attention_autotune_results(
    path, tmp_path, monkeypatch, own_cache
):
    """Configs the Triton tuner measured before the publish travel in the manifest and are
    adopted by a restore (which then skips their tuning); malformed ones are ignored."""
    from warmboot.kernels import tuning

    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    measured = {"fwd|cuda:H200|d128": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}}
    tuning.import_autotune_cache(measured, persist=False)
    store = tmp_path / "store"
    make_llm(path, store)  # cold boot: publishes
    manifest = Manifest.from_json(next((store / "manifests").glob("*.json")).read_bytes())
    assert manifest.facts["autotune"] == measured

    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())  # a fresh process: nothing measured
    assert tuning.export_autotune_cache() == {}
    restored = make_llm(path, store)
    assert restored.engine.start_info.path == "restored_image"
    assert tuning.export_autotune_cache() == measured

    manifest_path = next((store / "manifests").glob("*.json"))
    doc = json.loads(manifest_path.read_text())
    doc["facts"]["autotune"] = measured | {"evil": {"BLOCK_M": "__import__('os')"}}
    manifest_path.write_text(json.dumps(doc))
    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    assert make_llm(path, store).engine.start_info.path == "restored_image"
    assert tuning.export_autotune_cache() == measured


# -- a store nobody trusts (issue 15, first slice): refused with a reason, never a hang -----------
def _rewrite(store: LocalStore, key: str, change) -> None:
    data = json.loads(store.get_manifest(key))
    change(data)
    store.put_manifest(key, json.dumps(data).encode())


def test_a_fifo_for_a_chunk_or_a_manifest_never_blocks(path, golden, store):
    import os

    chunk = embed(store, golden[1]).chunks[0].hash
    chunk_file = store.root / "chunks" / chunk[:2] / chunk
    chunk_file.unlink()
    os.mkfifo(chunk_file)
    assert_cold_fallback(path, store, golden, "is not a regular file")
    manifest_file = store.root / "manifests" / f"{golden[1]}.json"
    manifest_file.unlink()
    os.mkfifo(manifest_file)
    assert_cold_fallback(path, store, golden, "is not a regular file")


def test_chunk_names_and_links_out_of_the_store_are_refused(path, golden, store, tmp_path):
    def escape(data):
        data["tensors"][0]["chunks"][0]["hash"] = "../../../etc/passwd"

    _rewrite(store, golden[1], escape)
    assert_cold_fallback(path, store, golden, "bad chunk reference")
    # the store itself refuses such a name, whoever asks (tier-P manifests name chunks too)
    with pytest.raises(IntegrityError, match="is not a SHA-256 hex digest"):
        store.read_chunk("../../../etc/passwd", memoryview(bytearray(8)))
    with pytest.raises(SnapshotError, match="is not a key"):
        store.get_manifest("../../x")


def test_a_chunk_directory_linking_outside_is_refused(path, golden, store, tmp_path):
    chunk = embed(store, golden[1]).chunks[0].hash
    inner = store.root / "chunks" / chunk[:2]
    outside = tmp_path / "outside"
    shutil.move(inner, outside)
    inner.symlink_to(outside, target_is_directory=True)
    assert_cold_fallback(path, store, golden, "leads outside the store")


def test_a_tensor_the_model_lacks_or_a_float_listed_as_int_boots_cold(path, golden, store):
    def rename(data):
        data["tensors"][0]["name"] = "no.such.weight"

    _rewrite(store, golden[1], rename)
    assert_cold_fallback(path, store, golden, "does not fit")


def test_a_float_weight_listed_as_int32_boots_cold(path, golden, store):
    def relabel(data):
        entry = next(t for t in data["tensors"] if t["dtype"] == "float32")
        entry["dtype"] = "int32"

    _rewrite(store, golden[1], relabel)
    assert_cold_fallback(path, store, golden, "are not float32")


def test_a_huge_manifest_is_refused_unread(path, golden, store, monkeypatch):
    from warmboot.snapshot import store as store_mod

    monkeypatch.setattr(store_mod, "MAX_MANIFEST_BYTES", 1000)
    assert_cold_fallback(path, store, golden, "exceeds 1000 bytes")


def test_a_deeply_nested_manifest_is_a_reason_not_a_traceback(path, golden, store):
    from warmboot.snapshot import process_image

    deep = b"[" * 200_000 + b"]" * 200_000
    (store.root / "manifests" / f"{golden[1]}.json").write_bytes(deep)
    assert_cold_fallback(path, store, golden, "is not valid JSON")
    with pytest.raises(process_image.ProcessImageError, match="not JSON"):
        process_image.parse(deep)
    with pytest.raises(process_image.ProcessImageError, match="not a JSON object"):
        process_image.parse(b"[1]")
