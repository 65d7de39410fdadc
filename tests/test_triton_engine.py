"""The engine end to end with the Triton backend in the interpreter: the same greedy tokens
as the torch backend (decode, chunked prefill over cached context, prefix hits, windows)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import assert_engine_clean, guard_captured_region, random_prompts  # noqa: E402
from tests.tiny_models import VOCAB_SIZE  # noqa: E402
from warmboot import LLM, SamplingParams  # noqa: E402
from warmboot.engine.settings import attention_backend as _attention_backend  # noqa: E402

MAX_NEW = 6


def _greedy(path, backend: str, prompts, graphs: bool = False) -> list[list[int]]:
    llm = LLM(
        str(path),
        max_model_len=96,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        attention_backend=backend,
    )
    assert llm.engine.facts.attention_backend == backend
    if graphs:  # the graph path's full-width block tables, stale columns and padding rows
        llm.engine.enable_decode_graphs((2, 4), emulate=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_engine_clean(llm)
    if graphs:
        assert llm.stats()["graph_steps"] >= MAX_NEW - 1
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # the engine on Triton kernels in the interpreter
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2_softcap", "llama4_text"])
def test_greedy_matches_torch_backend(kind, tiny_model_dir):
    """Windows (Mistral), soft-capped scores (Gemma 2), chunks of 8 (Llama 4) too."""
    path = tiny_model_dir(kind)
    prompts = random_prompts([30, 3, 17], VOCAB_SIZE, seed=11)
    prompts.append(prompts[0][:16] + [5, 6])  # a prefix-cache hit: prefill over cached blocks
    assert _greedy(path, "triton", prompts) == _greedy(path, "torch", prompts)


@pytest.mark.slow  # the engine on Triton kernels in the interpreter
def test_decode_graph_path_matches_torch_backend(tiny_model_dir, monkeypatch):
    """The graph path's tokens equal the torch backend's, and what a graph captures (the
    Triton decode forward) has no op that would break a CUDA-graph capture."""
    path = tiny_model_dir("llama")
    prompts = random_prompts([13, 3, 6], VOCAB_SIZE, seed=12)  # 3 rows padded to 4
    expect = _greedy(path, "torch", prompts)
    guard = guard_captured_region(monkeypatch)
    assert _greedy(path, "triton", prompts, graphs=True) == expect
    assert guard.ops > 100 and guard.hits == []


def test_backend_selection():
    cpu = torch.device("cpu")
    assert _attention_backend("auto", cpu).name == "torch"
    assert _attention_backend("triton", cpu).name == "triton"
    with pytest.raises(ValueError, match="unknown"):
        _attention_backend("flash", cpu)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _attention_backend("triton", torch.device("cpu"))
