"""The step that serves is chosen by measurement (``device.step_choice``): compiled with the
native or oneDNN GEMM, or eager, and whatever is chosen serves the right tokens."""

from __future__ import annotations

import pytest

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.config import EAGER_ENV
from warmboot.device import step_choice
from warmboot.device.step_choice import StepChoice
from warmboot.kernels import native
from warmboot.kernels.step_ops import onednn_bf16


def _engine(path, dtype: str, eager: bool | None, **kw) -> LLM:
    return LLM(
        str(path),
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        **kw,
    )


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _fake_times(ms: dict[str, float]):
    """``_time_steps`` stand-in: the candidate now set up (compiled kernel or eager) takes
    ``ms`` per step at either row count."""

    def fake(runner, steps) -> dict[str, float]:
        name = f"compiled/{steps.linears.kernel}" if steps is not None else "eager"
        name += "+helper" if runner.stream.helpers else ""
        return {"1": ms[name], "16": ms[name]}

    return fake


@pytest.mark.skipif(native.library() is None, reason=f"{native.unavailable_reason()}")
@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN packs bf16 only with AVX-512: not here")
def test_the_fastest_candidate_serves(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 9], VOCAB_SIZE, seed=4)]
    llm = _engine(path, "bfloat16", eager=False)
    runner = llm.engine.runner
    steps = runner.compiled
    times = {"compiled/native": 3.0, "compiled/native+helper": 4.0, "compiled/onednn": 2.0}
    times |= {"eager": 5.0}
    monkeypatch.setattr(step_choice, "_time_steps", _fake_times(times))
    choice = step_choice.choose(runner, steps)
    assert (choice.mode, choice.kernel) == ("compiled", "onednn")
    assert all(w.dim() == 2 for w, _ in steps.linears.layers[0])
    onednn = _greedy(llm, prompts)
    assert len(onednn) == 2 and all(len(t) == 6 for t in onednn)
    times |= {"compiled/native": 1.0}
    assert step_choice.choose(runner, steps).kernel == "native"
    assert all(w.dim() == 4 for w, _ in steps.linears.layers[0])
    measured = step_choice.choose(runner, steps, allow_eager=False).ms_per_step
    helper = {"compiled/native+helper"} if runner.stream.lend_helpers(1) else set()
    runner.stream.lend_helpers(0)
    assert measured.keys() == {"compiled/native", "compiled/onednn"} | helper
    if helper:  # NOTE: a machine with a host core to spare (2+ usable cores)
        times |= {"compiled/native+helper": 0.9}
        choice = step_choice.choose(runner, steps)
        assert (choice.kernel, choice.helpers, runner.stream.helpers) == ("native", 1, 0)
        alone = _greedy(llm, prompts)
        assert runner.stream.lend_helpers(1) == 1
        for _ in range(4):  # NOTE: 5 decode steps a run: solo is timed at the EXPLORE-th
            assert _greedy(llm, prompts) == alone, "helpers change no bit of a GEMM"
        assert min(runner.stream.arms.steps) > 0, "steps run lent and solo, each timed"
        assert llm.engine.stats()["helper_steps"] == runner.stream.arms.steps
        runner.stream.lend_helpers(0)
    times |= {"eager": 0.5}
    assert step_choice.choose(runner, steps).mode == "eager"
    runner.install_compiled(None)
    llm.engine.block_manager.reset_prefix_cache()  # NOTE: K/V the compiled steps wrote
    assert _greedy(llm, prompts) == _greedy(_engine(path, "bfloat16", eager=True), prompts)


def test_an_unsaid_mode_is_measured_at_start(tiny_model_dir, monkeypatch):
    """Measured in the background: a first batch right after ``LLM()`` starts on eager steps
    (``last_generate_steps`` says so), a batch after the choice runs on the chosen step; and
    ``wait_for_compile=True`` returns with the choice made, as vLLM's ``LLM`` returns
    compiled."""
    monkeypatch.delenv(EAGER_ENV)  # NOTE: the suite's default says eager
    path, prompts = tiny_model_dir("qwen2"), random_prompts([5, 9], VOCAB_SIZE, seed=3)
    llm = _engine(path, "float32", eager=None)
    first = _greedy(llm, prompts)
    assert llm.stats()["last_generate_steps"].get("eager", 0) > 0
    assert llm.engine.wait_compiled(300)
    info = llm.engine.stats()["compile"]
    kind = "compiled" if info["compiled"] else "eager"
    assert _greedy(llm, prompts) == first
    assert llm.stats()["last_generate_steps"].keys() == {kind}
    waited = _engine(path, "float32", eager=None, wait_for_compile=True)
    assert "step_choice" in waited.stats()["compile"], "returned with the step chosen"
    assert _greedy(waited, prompts) == first
    assert waited.stats()["last_generate_steps"].keys() == {
        "compiled" if waited.stats()["compile"]["compiled"] else "eager"
    }
    served, last = waited.stats()["steps_served"], waited.stats()["last_generate_steps"]
    assert all(served[k] >= n for k, n in last.items()), "all steps count the batch's"
    assert info["background"], "a cold start of unsaid mode serves eagerly at once"
    choice = info["step_choice"]
    assert choice["source"] == "measured"
    # NOTE: fp32 has no native GEMM: oneDNN's compiled step against eager
    assert choice["ms_per_step"].keys() == {"compiled/onednn", "eager"}
    assert all(ms > 0 for c in choice["ms_per_step"].values() for ms in c.values())
    serving_compiled = llm.engine.runner.compiled is not None
    assert serving_compiled == (choice["mode"] == "compiled") == info["compiled"]


def test_a_recorded_choice_is_data_checked():
    assert StepChoice.from_fact({"mode": "eager", "kernel": "native"}).source == "recorded"
    assert StepChoice.from_fact({"mode": "compiled", "kernel": "native", "helpers": 1}).helpers == 1
    for bad in (None, "eager", {"mode": "fast", "kernel": "native"}, {"mode": "compiled"}):
        assert StepChoice.from_fact(bad) is None
    for helpers in (2, -1, "1", None):
        assert (
            StepChoice.from_fact({"mode": "compiled", "kernel": "native", "helpers": helpers})
            is None
        )


@pytest.mark.skipif(native.library() is None, reason=f"{native.unavailable_reason()}")
def test_dense_rows_is_where_torchs_gemm_wins_from_on(tiny_model_dir, monkeypatch):
    llm = _engine(tiny_model_dir("llama"), "bfloat16", eager=False)
    runner, table = llm.engine.runner, llm.engine.runner.compiled.linears
    table.use("native")

    def fake_best(plain_wins):
        def best(fn) -> float:
            rows = fn.args[0].shape[0]
            return 1.0 if (fn.func is step_choice._dense) == plain_wins(rows) else 2.0

        return best

    cases = {(lambda r: r >= 8): 8, (lambda r: r == 4 or r >= 16): 16, (lambda r: False): None}
    for plain_wins, want in cases.items():
        monkeypatch.setattr(step_choice, "_best", fake_best(plain_wins))
        assert step_choice.dense_rows(runner, table) == want
    monkeypatch.undo()
    measured = step_choice.dense_rows(runner, table)
    assert measured is None or measured in step_choice.PROBES
    table.set_dense_rows(2)  # NOTE: prefills and two-row decodes then run torch's GEMM
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 9], VOCAB_SIZE, seed=5)]
    got = _greedy(llm, prompts)
    assert len(got) == 2 and all(len(t) == 6 for t in got)


def test_a_recorded_dense_rows_is_data_checked():
    fact = {"mode": "compiled", "kernel": "native"}
    assert StepChoice.from_fact(fact).dense_rows is None
    assert StepChoice.from_fact(fact | {"dense_rows": 16}).dense_rows == 16
    for bad in (3, "16", 16.0, True, -1):
        assert StepChoice.from_fact(fact | {"dense_rows": bad}) is None


@pytest.mark.skipif(native.library() is None, reason=f"{native.unavailable_reason()}")
def test_weights_mapped_for_a_checkpoint_keep_the_step_chosen(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Before a process checkpoint a publisher swaps its weights for the snapshot's mapped
    copy and compiles its steps again: the step chosen at boot stands (the weights moved, the
    machine did not), and it serves the same tokens."""
    path = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 9], VOCAB_SIZE, seed=5)]
    llm = LLM(
        str(path),
        dtype="bfloat16",
        enforce_eager=False,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        snapshot_store=str(tmp_path / "store"),
    )
    engine = llm.engine
    engine.startup.wait_compiled()
    chosen = engine.startup.compiling.info["step_choice"]
    before = _greedy(llm, prompts)
    measured = []
    monkeypatch.setattr(step_choice, "choose", lambda *a, **k: measured.append(1))
    assert engine.remap_weights_from_snapshot(), "the weights are mapped from the snapshot"
    assert not measured, "not measured again"
    assert engine.startup.compiling.info["step_choice"] == chosen
    assert _greedy(llm, prompts) == before
