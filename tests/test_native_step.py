"""The compiled CPU step with its native parts: bf16 GEMMs on native panels, and steps that
skip dynamo's guards once warmed (``device.guard_gate``), with two models in one process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.device import guard_gate
from warmboot.kernels import native
from warmboot.kernels.step_ops import native_silu
from warmboot.models.layers.activation import GatedMLP


def _engine(path, dtype: str, eager: bool) -> LLM:
    return LLM(
        str(path),
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
    )


def _prompt_logprobs(llm: LLM, prompts) -> torch.Tensor:
    """Each prompt token's log-probability under the model (teacher-forced: no divergence)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = []
    for o in llm.generate(prompts, params):
        for tok, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True):
            out.append(entry[tok].logprob)
    return torch.tensor(out, dtype=torch.float64)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.skipif(native.library() is None, reason=f"{native.unavailable_reason()}")
def test_bf16_compiled_step_runs_the_native_gemm_within_bf16_error(tiny_model_dir):
    """The GEMMs on native panels, the gated MLP's activation fused (``packed_gated``) where
    the kernels run AVX-512 BF16."""
    path = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 5, 12], VOCAB_SIZE, seed=3)]
    compiled = _engine(path, "bfloat16", eager=False)
    table = compiled.engine.runner.compiled.linears
    table.use("native")  # NOTE: whichever kernel the start measured faster
    assert all(w.dim() == 4 for w, _ in table.layers[0]) and table.head.dim() == 4
    mlps = [m for m in compiled.engine.runner.compiled.model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(m.fused_silu == native_silu(torch.bfloat16) for m in mlps)
    got = _prompt_logprobs(compiled, prompts)
    want = _prompt_logprobs(_engine(path, "float32", eager=True), prompts)
    eager_bf16 = _prompt_logprobs(_engine(path, "bfloat16", eager=True), prompts)
    # NOTE: no further from fp32 than bf16's own eager step is (measured: both ~0.05 nats)
    assert (got - want).abs().max() <= max(0.1, 2 * (eager_bf16 - want).abs().max())


def test_two_warmed_models_step_unguarded_in_one_process(tiny_model_dir):
    """Guards skipped: each model still runs its own graph (the graphs tell them apart)."""
    a, b = tiny_model_dir("llama"), tiny_model_dir("qwen2")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 4], VOCAB_SIZE, seed=8)]
    want = [_greedy(_engine(p, "float32", eager=True), prompts) for p in (a, b)]
    engines = [_engine(p, "float32", eager=False) for p in (a, b)]
    assert all(e.engine.runner.compiled.guard_free for e in engines)
    for _ in range(2):  # NOTE: interleaved, each after the other's steps
        assert [_greedy(e, prompts) for e in engines] == want
    assert [e.engine.stats()["compile"]["graphs"] for e in engines] == [2, 2], "recompiled"


def test_a_guarded_call_waits_for_unguarded_steps_and_steps_keep_guards_meanwhile():
    events = []
    inside = threading.Event()

    def step() -> None:
        with guard_gate.unguarded():
            events.append(("step", guard_gate.skipping()))
            inside.set()
            time.sleep(0.2)
        events.append(("step done", guard_gate.skipping()))

    t = threading.Thread(target=step)
    t.start()
    inside.wait(5)
    with guard_gate.guarded():
        events.append(("compile", guard_gate.skipping()))
        with guard_gate.unguarded():  # a step during the compile: guarded
            events.append(("step in compile", guard_gate.skipping()))
    t.join()
    assert events == [
        ("step", True),
        ("step done", False),
        ("compile", False),
        ("step in compile", False),
    ]


def test_a_warmed_step_that_needs_a_trace_runs_guarded_instead_of_failing(
    tiny_model_dir, monkeypatch, caplog
):
    """Under the stance, torch refuses to trace (no cached graph's distinguishing guards
    pass); the step then runs again with its guards, which may trace."""
    llm = _engine(tiny_model_dir("llama"), "float32", eager=False)
    compiled = llm.engine.runner.compiled
    head, calls = compiled._head, []

    def refusing_once(*args):
        calls.append(guard_gate.skipping())
        if len(calls) == 1:
            raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
        return head(*args)

    monkeypatch.setattr(compiled, "_head", refusing_once)
    hidden = torch.randn(3, llm.engine.runner.model.lm_head.in_features)
    with torch.inference_mode():
        want = llm.engine.runner.model.compute_logits(hidden)
        got = compiled.logits(hidden)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls == [True, False] and "needed a new trace" in caplog.text


def test_layers_of_two_structures_run_in_one_guard_free_region(tiny_model_dir):
    """exaone4's global layers have no rope module: two nested layer regions in one graph
    (when each layer was a graph of its own, the stance confused the two: wrong tokens); the
    engine steps guard-free, beside another guard-free engine, with eager's tokens."""
    llm = _engine(tiny_model_dir("exaone4"), "float32", eager=False)
    assert llm.engine.stats()["compile"]["graphs"] == 2
    assert llm.engine.runner.compiled.guard_free
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 4], VOCAB_SIZE, seed=8)]
    want = _greedy(_engine(tiny_model_dir("exaone4"), "float32", eager=True), prompts)
    other = _engine(tiny_model_dir("llama"), "float32", eager=False)
    assert other.engine.runner.compiled.guard_free
    assert _greedy(llm, prompts) == want
    _greedy(other, prompts)
    assert _greedy(llm, prompts) == want
    # NOTE: the rows unbacked: the second layer structure did not specialise on rows
    assert llm.engine.stats()["compile"]["graphs"] == 2, "a step traced again while serving"
