"""Tier-A images carry the compile: a restore in a process with empty compiler caches loads
the image's artifacts and compiles nothing; artifacts under another key are never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmboot.kernels import native

ROOT = Path(__file__).resolve().parent.parent
BOOT = """
import json, sys
from warmboot import LLM, SamplingParams
from warmboot.kernels import native
llm = LLM(sys.argv[1], snapshot_store=sys.argv[2], enforce_eager=False, max_model_len=64,
          block_size=4, num_kv_blocks=64)
out = llm.generate({"prompt_token_ids": [5, 9, 2, 7, 11]},
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
info = llm.engine.start_info
assert llm.engine.wait_compiled(300)
print(json.dumps({"path": info.path, "reason": info.reason, "phases": llm.engine.startup_times,
                  "ready_phases": info.phase_times,
                  "compile": llm.engine.stats()["compile"],
                  "tokens": out[0].outputs[0].token_ids, "native": str(native.library())}))
"""


def _boot(model: Path, store: Path, caches: Path, key: str, cache_root: Path | None = None) -> dict:
    """One engine start in a fresh process whose compiler caches start empty (and its
    ``$WARMBOOT_CACHE``, where given)."""
    caches.mkdir()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches), WARMBOOT_ARTIFACT_KEY=key)
    if cache_root is not None:
        env["WARMBOOT_CACHE"] = str(cache_root)
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", BOOT, str(model), str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def published(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("compile-snap")
    native.library()  # NOTE: built ahead (``make test`` does), so the cold boot loads it
    model, store = tiny_model_dir("qwen3"), root / "store"
    cold = _boot(model, store, root / "cold-cache", key="fleet-key-1")
    return model, store, root, cold


def test_cold_boot_compiles_and_publishes_the_artifacts(published):
    _, store, _, cold = published
    assert cold["path"] == "cold" and "published" in cold["reason"], cold["reason"]
    assert cold["compile"]["compiled"] and cold["compile"]["cache_misses"] >= 1
    manifest = json.loads(next((store / "manifests").iterdir()).read_text())
    art = manifest["facts"]["compile_artifacts"]
    assert art["bytes"] > 0 and len(art["hmac"]) == 64
    assert any(f["path"] == "compile/inductor.bin" for f in manifest["files"])
    choice = manifest["facts"]["step_choice"]
    assert choice == cold["compile"]["step_choice"] and choice["source"] == "measured"
    if cold["native"] != "None":  # NOTE: a machine that builds the native kernels
        lib = manifest["facts"]["native_library"]
        assert lib["bytes"] == Path(cold["native"]).stat().st_size and len(lib["hmac"]) == 64
        assert any(f["path"] == "compile/warmboot_native.so" for f in manifest["files"])


def test_restore_loads_the_artifacts_and_compiles_nothing(published):
    model, store, root, cold = published
    warm = _boot(model, store, root / "restore-cache", key="fleet-key-1")
    assert warm["path"] == "restored_image", warm["reason"]
    info = warm["compile"]
    assert info["artifacts"].startswith("compile artifacts loaded"), info
    assert "cache files written" in info["artifacts"], "the kernels come with the image"
    assert info["cache_misses"] == 0 and info["cache_hits"] == info["graphs"] == 2, info
    assert warm["tokens"] == cold["tokens"]
    keys = ("mode", "kernel", "helpers", "dense_rows")
    want = {k: cold["compile"]["step_choice"][k] for k in keys}
    assert info["step_choice"] == want | {"ms_per_step": {}, "source": "recorded"}
    assert "step_choice" in cold["phases"] and "step_choice" not in warm["phases"]
    assert "compile_artifacts" in warm["phases"] and "load_weights" not in warm["phases"]
    assert warm["compile"]["background"], "a restore serves while its steps compile"
    assert "compile" not in warm["ready_phases"], "the restore waited for the compile"


def test_restore_on_a_fresh_machine_builds_no_native_library(published, tmp_path):
    """An empty ``$WARMBOOT_CACHE`` and no compiler: the image's library is placed and loads."""
    model, store, root, cold = published
    if cold["native"] == "None":
        pytest.skip("this machine builds no native kernels")
    fresh = tmp_path / "fresh-cache"
    os.environ["CXX"], cxx = "/nonexistent/g++", os.environ.get("CXX")
    try:
        warm = _boot(model, store, root / "fresh-machine", key="fleet-key-1", cache_root=fresh)
    finally:
        os.environ.pop("CXX") if cxx is None else os.environ.update(CXX=cxx)
    assert warm["path"] == "restored_image", warm["reason"]
    assert "native_library" in warm["phases"]
    assert warm["native"].startswith(str(fresh / "native")), warm["native"]
    assert Path(warm["native"]).read_bytes() == Path(cold["native"]).read_bytes()
    assert warm["tokens"] == cold["tokens"]


def test_artifacts_under_another_key_are_not_loaded(published):
    model, store, root, cold = published
    other = _boot(model, store, root / "other-key-cache", key="someone-else")
    assert other["path"] == "restored_image", other["reason"]
    info = other["compile"]
    assert "not signed with this host's key" in info["artifacts"], info
    assert info["cache_misses"] >= 1, "compiled from scratch instead"
    assert other["tokens"] == cold["tokens"]


def test_a_bf16_image_restores_whatever_step_serves(tiny_model_dir, tmp_path, monkeypatch):
    """bf16, mode unsaid: the publishing boot compiles in the foreground, a restore in the
    background, and compiled and eager bf16 steps round differently. The canary is recorded
    and checked on the same (eager) steps, so the restore is not refused for it."""
    from warmboot import LLM
    from warmboot.config import EAGER_ENV

    monkeypatch.delenv(EAGER_ENV)
    args = dict(
        snapshot_store=str(tmp_path / "store"),
        dtype="bfloat16",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
    )
    cold = LLM(str(tiny_model_dir("llama")), **args)
    assert cold.engine.start_info.path == "cold" and cold.engine.wait_compiled(300)
    warm = LLM(str(tiny_model_dir("llama")), **args)
    info = warm.engine.start_info
    assert info.path == "restored_image", info.reason
    assert warm.engine.wait_compiled(300)
