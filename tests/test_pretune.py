"""Tuning the prefill kernel for every shape bucket at start-up, before a snapshot is
published: the shapes cover every bucket pair a prefill can meet, and the engine runs the
tuning before the publish, so the snapshot carries its results. The tuning itself needs a
GPU (bench/gpu_check.py)."""

from __future__ import annotations

import itertools
import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot import LLM  # noqa: E402
from warmboot.engine import settings as llm_engine  # noqa: E402
from warmboot.kernels import tuning  # noqa: E402
from warmboot.kernels.torch_attention import TorchAttentionBackend  # noqa: E402
from warmboot.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from warmboot.snapshot.image import Manifest  # noqa: E402


def _lengths(top: int) -> list[int]:
    """1, top, and both sides of every bucket edge up to ``top``."""
    edges = {1, top}
    for b in tuning.SEQLEN_BUCKETS:
        edges |= {b - 1, b, b + 1}
    return sorted(n for n in edges if 1 <= n <= top)


@pytest.mark.parametrize("max_q, max_k", [(2048, 4096), (8192, 32768), (100, 96), (300, 5000)])
def test_prefill_shapes_cover_every_reachable_bucket_pair(max_q, max_k):
    shapes = tuning.prefill_shapes(max_q, max_k)
    for q, k in shapes:
        assert 1 <= q <= min(max_q, k) and k <= max_k, (q, k)
    tuned = {(tuning.seqlen_bucket(q), tuning.seqlen_bucket(k)) for q, k in shapes}
    assert len(tuned) == len(shapes), "one shape per bucket pair"
    reachable = {
        (tuning.seqlen_bucket(q), tuning.seqlen_bucket(k))
        for q, k in itertools.product(_lengths(max_q), _lengths(max_k))
        if q <= k
    }
    assert tuned == reachable


def test_when_start_up_tunes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert llm_engine.wants_pretune(None, cuda, "triton", publishing=True)
    assert not llm_engine.wants_pretune(None, cuda, "triton", publishing=False)
    assert llm_engine.wants_pretune(True, cuda, "triton", publishing=False)
    assert not llm_engine.wants_pretune(False, cuda, "triton", publishing=True)
    assert not llm_engine.wants_pretune(True, cuda, "torch", publishing=True)
    assert not llm_engine.wants_pretune(True, cpu, "triton", publishing=True)


def test_nothing_to_tune_off_the_gpu():
    cache = torch.zeros(4, 16, 2, 8)
    args = (cache, cache, 4, 0.35, {None}, 64, 64)
    assert TritonAttentionBackend().pretune(*args) == 0
    assert TorchAttentionBackend().pretune(*args) == 0


def test_tuning_runs_before_the_publish(path, tmp_path, monkeypatch, own_cache):
    """With tuning due (as on a GPU), start-up tunes every shape for the model's windows,
    then publishes: the snapshot carries what the tuning measured."""
    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    calls = []

    def pretune(self, k_cache, v_cache, num_heads, scale, windows, max_q, max_k):
        calls.append((tuple(k_cache.shape), num_heads, windows, max_q, max_k))
        tuning.import_autotune_cache({"fwd:pretuned": {"BLOCK_M": 64}}, persist=False)
        return 7

    monkeypatch.setattr(TorchAttentionBackend, "pretune", pretune)
    monkeypatch.setattr(llm_engine, "wants_pretune", lambda setting, dev, name, publishing: True)
    store = tmp_path / "store"
    llm = LLM(
        str(path),
        max_model_len=96,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=40,
        snapshot_store=str(store),
    )
    cfg = llm.engine.model_config
    ((shape, heads, windows, max_q, max_k),) = calls
    assert shape == (64 + 1, 4, cfg.num_kv_heads, cfg.head_dim)  # + the scratch block
    assert heads == cfg.num_heads
    specs = llm.engine.runner.model.attention_specs()
    assert windows == {s.sliding_window for s in specs} and (max_q, max_k) == (40, 96)
    phases = list(llm.engine.start_info.phase_times)
    assert phases.index("autotune") < phases.index("snapshot_publish")
    manifest = Manifest.from_json(next((store / "manifests").glob("*.json")).read_bytes())
    assert manifest.facts["autotune"] == {"fwd:pretuned": {"BLOCK_M": 64}}
