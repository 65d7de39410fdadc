"""Tier P under gVisor: boot cold and publish, restore and answer the same, and every
injected fault ends in a cold boot that still answers the same."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from warmboot.config import resolve_eager
from warmboot.launcher import engine_process, runsc_image
from warmboot.launcher import launch as launch_mod
from warmboot.launcher.launch import LaunchConfig, launch
from warmboot.launcher.sandbox import runsc_status
from warmboot.sampling_params import SamplingParams
from warmboot.snapshot import process_image
from warmboot.snapshot.canary import HALF_ATOL, canary_mismatch
from warmboot.snapshot.store import open_store

RUNSC, NO_RUNSC = runsc_status()
pytestmark = [pytest.mark.skipif(RUNSC is None, reason=f"gVisor: {NO_RUNSC}"), pytest.mark.slow]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _answer(client) -> list[int]:
    async def main():
        stream = await client.add_request({"prompt_token_ids": [3, 1, 4, 1, 5]}, PARAMS)
        return [o async for o in stream][-1].outputs[0].token_ids

    return asyncio.run(main())


def _launch(cfg: LaunchConfig):
    client = launch(cfg)
    try:
        return client.start_info, _answer(client)
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def published(path, tmp_path_factory):
    """A store with a process image (from the first, cold start) and that start's answer."""
    root = tmp_path_factory.mktemp("launcher")
    store = root / "store"
    engine = {"model": str(path), "max_model_len": 128, "snapshot_store": str(store)}
    cfg = LaunchConfig(engine=engine, store=str(store), work_dir=root / "work")
    info, answer = _launch(cfg)
    assert info.path == "cold" and "published" in info.reason, info
    assert "no process snapshot" in info.reason, info
    assert "unpack_image" in info.phase_times, info
    return cfg, answer


@pytest.fixture
def faulty(published):
    """The published launch with publishing off; the store is put back afterwards."""
    cfg = replace(published[0], publish=False)
    root = Path(cfg.store)
    backup = root.parent / "store-backup"
    shutil.copytree(root, backup)
    yield cfg
    shutil.rmtree(root)
    backup.rename(root)


def _image_chunk(cfg: LaunchConfig):
    store = open_store(cfg.store)
    key = next(k for k in store.list_keys() if k.startswith(process_image.PREFIX))
    manifest = json.loads(store.get_manifest(key))
    return store, key, manifest


def _image_hash(manifest: dict) -> str:
    (entry,) = manifest["files"]
    assert entry["name"] == "checkpoint.img" and len(entry["chunks"]) == 1, entry
    return entry["chunks"][0]["sha256"]


def test_restore_answers_like_the_cold_boot(published, monkeypatch):
    cfg, answer = published
    read_ahead = []
    prefetch = process_image.prefetch_mapped
    monkeypatch.setattr(
        process_image, "prefetch_mapped", lambda *a: read_ahead.append(prefetch(*a))
    )
    engine_process.prestart(None, None)  # NOTE: as serve does; a restore has no use for it
    spare = engine_process._spare[-1][1].proc
    chosen, told = [], []
    info, again = _launch(replace(cfg, on_path=chosen.append, on_recorded=told.append))
    assert chosen == [True], "told once, as runsc restore started: the engine in gVisor"
    assert told == [True], "the next start restores too (no costs compared in the suite)"
    assert info.path == "restored_process" and "canary ok" in info.reason
    assert spare.wait(10) is not None and not engine_process._spare, "the spare was ended"
    assert read_ahead and read_ahead[0] is not None, "the mapped weights are read ahead"
    assert set(info.phase_times) >= {"runsc_restore", "verify_image", "start_and_canary"}
    assert again == answer
    store, _, manifest = _image_chunk(cfg)
    stored, deflated = runsc_image.chunk_kinds(store.local_chunk_path(_image_hash(manifest)))
    assert stored > deflated > 0, "runsc inflates only the chunks deflate shrank well"


def test_flipped_byte_in_the_image_falls_back(published, faulty):
    cfg = faulty
    store, _, manifest = _image_chunk(cfg)
    chunk = manifest["files"][0]["chunks"][0]["sha256"]
    path = store.local_chunk_path(chunk)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    info, answer = _launch(cfg)
    assert info.path == "cold" and "corrupt" in info.reason
    assert info.fallbacks == ("restore_failed",)
    assert answer == published[1]


def test_a_broken_image_that_hashes_fine_falls_back(published, faulty):
    """runsc itself rejects the image (what a bad restore looks like)."""
    cfg = faulty
    store, key, manifest = _image_chunk(cfg)
    garbage = b"not a checkpoint" * 1000
    h = process_image.hashlib.sha256(garbage).hexdigest()
    store.put_chunk(h, garbage)
    manifest["files"] = [
        {"name": "checkpoint.img", "chunks": [{"sha256": h, "size": len(garbage)}]}
    ]
    store.put_manifest(key, json.dumps(manifest).encode())
    info, answer = _launch(cfg)
    assert info.path == "cold" and "unusable" in info.reason
    assert answer == published[1]


def test_canary_mismatch_discards_the_image(published, faulty):
    cfg = faulty
    store, key, manifest = _image_chunk(cfg)
    manifest["canary"][0][0] += 1
    store.put_manifest(key, json.dumps(manifest).encode())
    info, answer = _launch(cfg)
    assert info.path == "cold" and "canary mismatch" in info.reason
    assert info.fallbacks == ("canary_mismatch",), "counted for /metrics"
    assert answer == published[1]
    assert store.get_manifest(key) is None, "a failed image is discarded"


def test_newer_schema_and_key_mismatch_boot_cold(published, faulty):
    cfg = faulty
    store, key, manifest = _image_chunk(cfg)
    store.put_manifest(key, json.dumps({**manifest, "schema": 99}).encode())
    info, answer = _launch(cfg)
    assert info.path == "cold" and "schema 99" in info.reason and answer == published[1]
    store.put_manifest(
        key, json.dumps({k: v for k, v in manifest.items() if k != "files"}).encode()
    )
    info, answer = _launch(cfg)
    assert info.path == "cold" and "unusable" in info.reason and answer == published[1]
    # NOTE: a key that has no image boots as the published fixture's first start did
    from warmboot.launcher import spec

    other = replace(cfg, engine={**cfg.engine, "max_model_len": 96})
    keys = [
        spec.process_key(spec.process_key_fields(c.engine, RUNSC, launch_mod.worker_spec(c)))
        for c in (cfg, other)
    ]
    assert keys[0] != keys[1], "another engine setting is another process"
    assert process_image.lookup(store, keys[1]) is None


def test_restore_timeout_and_missing_runsc_fall_back_in_process(published, faulty, monkeypatch):
    cfg = replace(faulty, restore_timeout=0.001)
    info, answer = _launch(cfg)
    assert "sandboxed boot failed" in info.reason and answer == published[1]
    monkeypatch.setattr(
        "warmboot.launcher.sandbox.runsc_status", lambda: (None, "runsc is not installed")
    )
    info, answer = _launch(replace(cfg, restore_timeout=60))
    assert "runsc unavailable: runsc is not installed" in info.reason
    assert info.fallbacks == ("runsc_unavailable",)
    assert info.path == "restored_image", "the in-process boot still uses tier A"
    assert answer == published[1]
    assert canary_mismatch([[1, -0.5]], [[1, -0.50001]]) is None
    assert "token 0 is 2" in canary_mismatch([[1, -0.5]], [[2, -0.5]])


def test_a_half_precision_canary_allows_one_logit_step_and_no_more():
    """The 1.5B model's bf16 canary, recorded in gVisor (oneDNN without AVX-512 BF16) and
    reproduced outside: one bf16 step of the logit apart. Tier A allows that; tier P (the
    same process restored) and float32 engines do not, and tokens must always match."""
    recorded = [[67497, -8.563695], [4023, -8.785331]]
    outside = [[67497, -8.579291], [4023, -8.785353]]
    assert "logprob 0" in canary_mismatch(recorded, outside)
    assert canary_mismatch(recorded, outside, HALF_ATOL) is None
    wrong = [[67497, -8.563695 + 4 * HALF_ATOL], [4023, -8.785331]]
    assert "logprob 0" in canary_mismatch(recorded, wrong, HALF_ATOL)
    flipped = [[67497, -8.563695], [4024, -8.785331]]
    assert "token 1 is 4024" in canary_mismatch(recorded, flipped, HALF_ATOL)


def test_a_sandboxed_worker_runs_one_torch_thread_unless_told(tmp_path):
    """gVisor traps the futexes of torch's thread pool (docs/benchmarks/sandbox_threads.md)."""
    cfg = LaunchConfig(engine={"model": str(tmp_path)}, work_dir=tmp_path / "work")
    argv = launch_mod.worker_spec(cfg).argv
    assert argv[1:4] == ["-P", "-m", "warmboot.launcher.worker"], "cwd never shadows modules"
    engine = json.loads(argv[-1])
    # NOTE: the worker's environment is fixed, so the eager default is resolved out here
    assert engine == {
        "model": str(tmp_path),
        "cpu_threads": 1,
        "enforce_eager": resolve_eager(None),
    }
    cfg = replace(cfg, engine={"model": str(tmp_path), "cpu_threads": 3, "enforce_eager": False})
    told = json.loads(launch_mod.worker_spec(cfg).argv[-1])
    assert told["cpu_threads"] == 3 and told["enforce_eager"] is False
    cfg = replace(cfg, engine={"model": str(tmp_path), "cpu_threads": 3})
    assert cfg.engine == {"model": str(tmp_path), "cpu_threads": 3}  # not mutated


def test_the_worker_is_handed_the_hosts_native_cache_outside_the_key(tmp_path, monkeypatch):
    """The host's native build reaches the worker (``kernels.native``), and where that cache
    lies is no part of the process key (a copied store restores under another $HOME)."""
    from warmboot.host import HOST_NATIVE_ENV
    from warmboot.launcher import spec
    from warmboot.snapshot import key as key_mod

    monkeypatch.delenv("WARMBOOT_CACHE", raising=False)
    monkeypatch.setattr(key_mod, "model_files_digest", lambda model: "a model")
    cfg = LaunchConfig(engine={"model": str(tmp_path)}, work_dir=tmp_path / "work")
    keys = []
    for home in ("/home/a", "/home/b"):
        monkeypatch.setattr(spec, "cache_root", lambda h=home: Path(h) / ".cache" / "warmboot")
        worker = launch_mod.worker_spec(cfg)
        assert worker.env[HOST_NATIVE_ENV] == f"{home}/.cache/warmboot/native"
        keys.append(spec.process_key(spec.process_key_fields(cfg.engine, RUNSC, worker)))
    assert keys[0] == keys[1]


# -- issue 15: the store is data, not a place; the worker survives a failed publish ------------
def _moved(cfg: LaunchConfig, store: Path, **kw) -> LaunchConfig:
    engine = {**cfg.engine, "snapshot_store": str(store)}
    return replace(cfg, store=str(store), engine=engine, **kw)


def test_a_copied_store_restores_from_another_working_directory(published, tmp_path, monkeypatch):
    cfg, answer = published
    copy = tmp_path / "copied"
    shutil.copytree(cfg.store, copy)
    monkeypatch.chdir(tmp_path)
    info, again = _launch(_moved(cfg, copy, publish=False))
    assert info.path == "restored_process", info.reason
    assert again == answer


def test_rm_of_the_tier_a_image_keeps_the_weights_a_process_image_maps(published, faulty):
    from warmboot.snapshot.ops import remove_snapshot

    store, _, manifest = _image_chunk(faulty)
    assert manifest["mapped_chunks"], "precondition: the image maps the tier-A weights"
    for key in [k for k in store.list_keys() if not process_image.is_process_key(k)]:
        remove_snapshot(store, key)
    assert set(manifest["mapped_chunks"]) <= set(store.list_chunks())
    info, answer = _launch(faulty)
    assert info.path == "restored_process", info.reason
    assert answer == published[1]


def test_restore_phases_and_leftovers_of_a_killed_launcher(published, faulty):
    """A restored process reports this start's phases (not its image's first boot), and the
    work dirs of launchers that are gone are swept (their own are kept)."""
    work = Path(faulty.work_dir)
    dead = work / "4194303-0123456789ab"  # NOTE: above any pid this kernel hands out
    (dead / "image").mkdir(parents=True)
    (dead / "image" / "checkpoint.img").write_bytes(b"x" * 4096)
    live = work / "1-keep"  # init is alive
    live.mkdir(parents=True, exist_ok=True)
    client = launch(faulty)
    try:
        assert client.start_info.path == "restored_process"
        phases = client.stats()["startup_times"]
        assert {"fetch_image", "runsc_restore", "start_and_canary"} <= set(phases), phases
        assert not any(p.startswith("worker.") or p == "load_weights" for p in phases), phases
    finally:
        client.shutdown()
    assert not dead.exists() and live.exists()
    live.rmdir()


def test_a_failed_publish_keeps_the_checked_worker(published, tmp_path, monkeypatch):
    from warmboot.launcher.remote import RemoteLLM
    from warmboot.snapshot.store import LocalStore

    cfg = _moved(published[0], tmp_path / "full")
    real = LocalStore.put_manifest

    def full(self, key, data):
        if process_image.is_process_key(key):
            raise OSError(28, "No space left on device")
        return real(self, key, data)

    monkeypatch.setattr(LocalStore, "put_manifest", full)
    client = launch(cfg)
    try:
        assert isinstance(client, RemoteLLM), "the worker serves; no second engine in-process"
        assert client.start_info.path == "cold" and "publish failed" in client.start_info.reason
        assert _answer(client) == published[1]
    finally:
        client.shutdown()
    store = open_store(cfg.store)
    keys = store.list_keys()
    assert not any(process_image.is_process_key(k) for k in keys)
    from warmboot.snapshot.ops import manifest_refs

    live = set().union(*(manifest_refs(store, k)[0] for k in keys))
    assert set(store.list_chunks()) == live, "the failed publish left image chunks behind"


def test_a_held_publish_lease_serves_the_booted_worker(published, tmp_path):
    """Another server is publishing this key's image: this one serves its worker as booted
    (no checkpoint, no second image)."""
    from warmboot.launcher import spec
    from warmboot.snapshot.lease import try_lease

    cfg = _moved(published[0], tmp_path / "leased")
    fields = spec.process_key_fields(cfg.engine, RUNSC, launch_mod.worker_spec(cfg))
    store = open_store(cfg.store)
    held = try_lease(store, f"publish-{process_image.manifest_key(spec.process_key(fields))}")
    assert held is not None
    info, answer = _launch(cfg)
    assert info.path == "cold" and "is publishing the image" in info.reason, info.reason
    assert "checkpoint" not in info.phase_times
    assert answer == published[1]
    assert not any(process_image.is_process_key(k) for k in store.list_keys())


def test_the_workers_tier_a_image_restores_outside_the_sandbox(published, faulty):
    """gVisor hides CPU flags (avx512_bf16 and others here); the worker keys its tier-A image
    with the host's flags, so an engine outside the sandbox restores it."""
    from warmboot import LLM
    from warmboot.snapshot.key import host_cpu_features

    store = open_store(faulty.store)
    (key,) = [k for k in store.list_keys() if not process_image.is_process_key(k)]
    fields = json.loads(store.get_manifest(key))["fields"]
    assert host_cpu_features().endswith(fields["device.cpu_flags"])
    llm = LLM(**faulty.engine, snapshot_publish=False)
    assert llm.engine.start_info.path == "restored_image", llm.engine.start_info.reason


def test_a_stalled_store_never_holds_a_tier_p_start(published, faulty, monkeypatch):
    import threading

    from warmboot.snapshot.store import LocalStore

    release, real, link = threading.Event(), LocalStore.read_chunk, process_image._link
    monkeypatch.setattr(
        LocalStore, "read_chunk", lambda self, h, out: release.wait(120) and real(self, h, out)
    )
    monkeypatch.setattr(process_image, "_link", lambda *a: release.wait(120) and link(*a))
    cfg = replace(faulty, engine={**faulty.engine, "snapshot_timeout": 2.0})
    try:
        info, answer = _launch(cfg)
    finally:
        release.set()
    assert "process image fetch: no progress for 2 s" in info.reason, info.reason
    assert info.path == "cold" and answer == published[1]
    assert _image_chunk(cfg)[2]["files"], "a stalled store is no reason to discard the image"


def test_a_compiled_worker_restores_without_compiling(path, tmp_path):
    """Compiled steps inside gVisor: the first start compiles in the worker and publishes
    the compiled process; its restore runs those graphs (no compile phase in this start's
    phases) and answers as the cold start did."""
    store = tmp_path / "store"
    engine = {
        "model": str(path),
        "max_model_len": 128,
        "snapshot_store": str(store),
        "dtype": "bfloat16",
    }
    cfg = LaunchConfig(
        engine=engine | {"enforce_eager": False}, store=str(store), work_dir=tmp_path / "work"
    )
    info, answer = _launch(cfg)
    assert info.path == "cold" and "published" in info.reason, info
    client = launch(cfg)
    try:
        assert client.start_info.path == "restored_process", client.start_info
        stats = client.stats()
        assert stats["compile"]["compiled"] and stats["compile"]["graphs"] == 2, stats["compile"]
        assert not any("compile" in p for p in stats["startup_times"]), stats["startup_times"]
        assert _answer(client) == answer
    finally:
        client.shutdown()
    tier_a, extra = _mapped_beyond_tier_a(open_store(str(store)))
    native = stats["compile"]["step_choice"]["kernel"] == "native"  # NOTE: oneDNN's: repacked
    assert tier_a and bool(extra) == native, "natively packed weights are mapped from the store"


def _mapped_beyond_tier_a(store) -> tuple[set[str], set[str]]:
    """(the tier-A weights' chunks, the other chunks the process image maps)."""
    from warmboot.snapshot.image import Manifest

    keys = store.list_keys()
    (a_key,) = [k for k in keys if not process_image.is_process_key(k)]
    (p_key,) = [k for k in keys if process_image.is_process_key(k)]
    tier_a = set(Manifest.from_json(store.get_manifest(a_key)).chunk_refs())
    mapped = set(json.loads(store.get_manifest(p_key))["mapped_chunks"])
    return tier_a & mapped, mapped - tier_a


def test_a_moe_model_restores_from_a_process_image(tiny_model_dir, tmp_path):
    """Tier P with a mixture of experts (Qwen3-MoE; eager steps: the compiled worker's
    restore is ``test_a_compiled_worker_restores_without_compiling``): the restored process
    answers as the cold one did."""
    store = tmp_path / "store"
    engine = {"model": str(tiny_model_dir("qwen3_moe")), "max_model_len": 64}
    engine |= {"snapshot_store": str(store), "enforce_eager": True}
    cfg = LaunchConfig(engine=engine, store=str(store), work_dir=tmp_path / "work")
    info, answer = _launch(cfg)
    assert info.path == "cold" and "published" in info.reason, info
    restored, again = _launch(replace(cfg, publish=False))
    assert restored.path == "restored_process", restored
    assert again == answer
