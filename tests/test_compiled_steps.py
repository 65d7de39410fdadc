"""The compiled steps' parts: the packed weights' release and repack (around a process
checkpoint), the thread policy, and the settings that choose compiled, eager and dtype."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.config import EngineConfig, ModelConfig
from warmboot.device import threads
from warmboot.engine import settings


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_released_packed_weights_refuse_and_repack_to_the_same_tokens(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("qwen2")),
        enforce_eager=False,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 3], VOCAB_SIZE, seed=5)]
    before = _greedy(llm, prompts)
    table = llm.engine.runner.compiled.linears
    assert table.release() > 0 and table.head is None
    with pytest.raises(RuntimeError, match="released"):  # NOTE: never a silent wrong answer
        table.lookup(0, 0)
    table.repack()
    assert _greedy(llm, prompts) == before
    assert llm.engine.stats()["compile"]["graphs"] == 2, "repacking recompiled"


@pytest.mark.parametrize("kernel", ["native", "onednn"])
def test_stashed_packed_weights_are_mapped_from_the_store(
    tiny_model_dir, tmp_path, monkeypatch, kernel
):
    """Before a process checkpoint the packed weights move into the store and are mapped
    from its chunk files (several a weight here), answering the same without a recompile;
    oneDNN's opaque layout cannot be mapped: released, then repacked."""
    from warmboot.kernels.step_ops import native_gemm, onednn_bf16
    from warmboot.snapshot import stash
    from warmboot.snapshot.store import LocalStore

    if kernel == "onednn" and not onednn_bf16():
        pytest.skip("oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT: not here")

    monkeypatch.setattr(stash, "CHUNK_BYTES", 2 * 4096)
    llm = LLM(
        str(tiny_model_dir("qwen2")),
        enforce_eager=False,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        dtype="bfloat16",
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 3], VOCAB_SIZE, seed=5)]
    table = llm.engine.runner.compiled.linears
    table.use(kernel)
    before = _greedy(llm, prompts)
    packed = [w for row in table.layers for w, _ in row] + [table.head]
    kept = [w for w in packed if stash.stashable(w)]
    assert bool(kept) == (kernel == "native" and native_gemm(table.source(0, 0))), kept
    store = LocalStore(tmp_path / "store")
    keep, refs = stash.keeper(store)
    table.stash(keep)
    assert sum(refs.values()) == sum(w.numel() * w.element_size() for w in kept)
    assert not kept or len(refs) > len(kept), "a weight spans several chunks"
    maps = open("/proc/self/maps").read()
    assert all(str(store.local_chunk_path(h)) in maps for h in refs), "mapped from the store"
    if not kept:
        with pytest.raises(RuntimeError, match="released"):
            table.lookup(0, 0)
    table.repack()
    assert _greedy(llm, prompts) == before
    assert llm.engine.stats()["compile"]["graphs"] == 2, "stashing recompiled"


def test_thread_policy_leaves_the_host_a_core_and_pins_to_the_last_ones(monkeypatch):
    assert [threads.default_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert threads.usable_cpus() == [4, 5, 6, 7]
    assert threads.compute_cpus(1) == [7] and threads.compute_cpus(3) == [5, 6, 7]
    assert threads.compute_cpus(8) == [4, 5, 6, 7]


def test_the_device_thread_runs_pinned_with_its_threads(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), cpu_threads=1, max_model_len=64, num_kv_blocks=32)
    stream = llm.engine.runner.stream
    got = {}

    def probe():
        got["threads"] = torch.get_num_threads()
        got["cpus"] = sorted(os.sched_getaffinity(0))

    stream.submit(probe)
    stream.record().wait()
    assert got["threads"] == 1
    if stream.pinned:
        assert got["cpus"] == threads.compute_cpus(1)
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        LLM(str(tiny_model_dir("llama")), cpu_threads=0, max_model_len=64)


@pytest.mark.parametrize(
    ("ckpt", "flags", "want"),
    [
        ("bfloat16", "avx512f avx512_bf16", torch.bfloat16),
        ("bfloat16", "amx_bf16 amx_tile", torch.bfloat16),
        ("bfloat16", "avx2 avx512f", torch.float32),
        ("float32", "avx512_bf16", torch.float32),
    ],
)
def test_auto_dtype_on_the_cpu_follows_native_bf16(monkeypatch, ckpt, flags, want):
    from warmboot import host

    monkeypatch.setattr(host, "host_cpu_features", lambda: f"Some CPU | {flags}")
    cfg = _tiny_config(ckpt)
    assert settings.resolve_dtype("auto", cfg, torch.device("cpu")) == want
    assert settings.resolve_dtype("float32", cfg, torch.device("cpu")) == torch.float32


def test_eager_and_compiled_settings(monkeypatch):
    cfg = _tiny_config("float32")

    def resolved(env: str, **kw):
        monkeypatch.setenv("WARMBOOT_ENFORCE_EAGER", env)
        return settings.resolve(EngineConfig(model="m", **kw), cfg).compiled

    assert resolved("0") and not resolved("1")
    assert not resolved("0", enforce_eager=True) and resolved("1", enforce_eager=False)
    assert resolved("1", compile_steps=True) and not resolved("0", compile_steps=False)
    assert settings.resolve_compiled(None, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="contradict"):
        settings.resolve(EngineConfig(model="m", enforce_eager=True, compile_steps=True), cfg)


def _tiny_config(dtype: str) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "max_position_embeddings": 64,
            "dtype": dtype,
        }
    )


def test_compiling_again_frees_the_old_steps(tiny_model_dir):
    """Nothing (dynamo's code cache included) keeps replaced compiled steps and their packed
    weights alive: a process image would carry them."""
    import gc
    import weakref

    llm = LLM(str(tiny_model_dir("llama")), enforce_eager=False, max_model_len=64, num_kv_blocks=32)
    old = weakref.ref(llm.engine.runner.compiled)
    llm.engine.runner.setup_compiled()
    gc.collect()
    assert old() is None
