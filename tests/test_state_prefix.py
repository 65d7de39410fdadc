"""Prefix caching for models with state layers (``core.state_prefix``): states kept at block
boundaries, found by block hash, loaded into a new request's slot.

First torch-free, through the scheduler with a fake runner that simulates every state as the
tuple of tokens folded into it (a load, a clear, a save midway or at a row's end, in the
device's order: loads before the forward, saves during it), so each step proves a state layer
would start exactly from the tokens before the row, whatever the schedule (chunks, preemption,
eviction, two steps in flight). Then real hybrids against transformers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_scheduler import Driver, FakeRunner, make_request, reference_output
from warmboot.config import SchedulerConfig
from warmboot.core.scheduler import Scheduler
from warmboot.core.state_prefix import StatePrefix
from warmboot.core.types import RunnerOutput, SchedulerOutput

FIRST_ROW = 100


class StateRunner(FakeRunner):
    """``FakeRunner`` plus per-request states and checkpoint rows, as token tuples."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.states: dict[str, tuple[int, ...]] = {}
        self.rows: dict[int, tuple[int, ...]] = {}
        self.loads: list[tuple[str, int]] = []  # (request, tokens resumed)

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        contexts = {s.req_id: self._context(s) for s in out.scheduled}
        for s in out.scheduled:  # NOTE: before the forward: clears and loads
            if s.state_load is not None:
                self.states[s.req_id] = self.rows[s.state_load]
                self.loads.append((s.req_id, s.start_pos))
            elif s.start_pos == 0:
                self.states[s.req_id] = ()
        for s in out.scheduled:  # the forward, saving midway and at the row's end
            context = contexts[s.req_id]
            state = self.states[s.req_id]
            assert state == tuple(context[: s.start_pos]), f"{s.req_id} resumes a wrong state"
            for at, row in s.state_saves:
                assert 0 < at <= s.num_tokens and (s.start_pos + at) % self.bs == 0
                self.rows[row] = tuple(context[: s.start_pos + at])
            self.states[s.req_id] = tuple(context[: s.start_pos + s.num_tokens])
        return super().__call__(out)

    def _context(self, s) -> list[int]:
        context = list(s.prompt_token_ids)
        end = s.start_pos + s.num_tokens
        return context + [self.sampled[(s.req_id, p)] for p in range(len(context), end)]


def _driver(rows: int = 8, **kwargs) -> Driver:
    d = Driver(**kwargs)
    prefix = StatePrefix(d.kv, range(FIRST_ROW, FIRST_ROW + rows))
    cfg = d.sched.config
    d.sched = Scheduler(cfg, d.kv, prefix)
    d.runner = StateRunner(d.kv.block_size)
    return d


def _first_row(d: Driver, req_id: str):
    return d.rows(req_id)[0][1]


def test_a_shared_system_prompt_resumes_from_its_third_request():
    """The first request keeps nothing where the next ones leave it; the second computes in
    full and keeps its state where it left the first's tokens; the third starts there."""
    d = _driver()
    system = list(range(1, 23))  # 22 tokens: 5 full blocks of 4
    for i, tail in enumerate(([30, 31, 32], [40, 41], [50, 51, 52, 53])):
        d.add(make_request(f"r{i}", system + tail, max_tokens=3))
        d.run()
    assert _first_row(d, "r1").start_pos == 0 and _first_row(d, "r1").state_load is None
    third = _first_row(d, "r2")
    assert third.state_load is not None and third.start_pos == 20
    assert d.runner.loads == [("r2", 20)] and d.sched.prefix.loads == 1


@pytest.mark.parametrize(("length", "resumed"), [(18, 16), (16, 12)])
@pytest.mark.parametrize("pipelined", [False, True])
def test_an_identical_prompt_resumes_at_its_last_full_block(length, resumed, pipelined):
    """The lookup stops short of the block holding the last token (its logits are wanted)."""
    d = _driver()
    for name in ("a", "b"):
        d.add(make_request(name, list(range(1, length + 1)), max_tokens=3))
        d.run_pipelined() if pipelined else d.run()
    assert d.runner.loads == [("b", resumed)]


def test_a_conversation_resumes_its_next_turn_from_its_last_decode_boundary():
    d = _driver()
    first = make_request("turn1", list(range(1, 10)), max_tokens=12)  # 9 + 12 tokens
    d.add(first)
    d.run()
    history = list(first.prompt_token_ids) + reference_output(first)
    d.add(make_request("turn2", history + [7, 7, 7], max_tokens=2))
    d.run()
    assert d.runner.loads == [("turn2", 20)]  # the boundary the decode passed last


def test_kept_states_are_reused_least_recently_used_first():
    """One row: each new prompt's state evicts the last; a request that would have resumed
    from an evicted state computes in full (never a wrong state: the runner checks)."""
    d = _driver(rows=1)
    shared = list(range(1, 14))
    for i in range(4):
        d.add(make_request(f"r{i}", shared + [60 + i], max_tokens=1))
        d.run()
    assert d.sched.prefix.num_kept == 1
    d.sched.prefix.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    rows=st.integers(1, 6),
    budget=st.sampled_from([3, 8, 17, 64]),
    blocks=st.sampled_from([14, 20, 60]),
    pipelined=st.booleans(),
)
def test_every_resumed_state_is_the_tokens_before_the_row(seed, rows, budget, blocks, pipelined):
    """Requests sharing prefixes of any length (identical prompts, extended conversations),
    in chunks, with preemption and eviction, one or two steps in flight."""
    rng = random.Random(seed)
    d = _driver(rows=rows, num_blocks=blocks, budget=budget, max_num_seqs=4)
    bases = [[rng.randint(1, 50) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    for i in range(10):
        base = rng.choice(bases)
        prompt = base[: rng.randint(1, len(base))] + [rng.randint(1, 50)] * rng.randint(0, 5)
        d.add(make_request(f"q{i}", prompt, max_tokens=rng.randint(1, 6)))
    d.run_pipelined() if pipelined else d.run()
    d.sched.prefix.check_invariants()
    for out in d.outs:
        for s in out.scheduled:
            assert all(FIRST_ROW <= row < FIRST_ROW + rows for _, row in s.state_saves)


def test_the_scheduler_config_is_unchanged_by_kept_states():
    """Kept states change where a request starts, never what the step may hold."""
    d = _driver(budget=8)
    assert d.sched.config == SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8)
    d.add(make_request("x", 30, max_tokens=2))
    d.run()
    assert max(o.num_batched_tokens for o in d.outs) <= 8


# -- real hybrids against transformers ----------------------------------------------------------
KINDS = ["qwen3_5", "kimi_linear", "granitemoehybrid", "lfm2"]
"""One per state op: the gated delta rule with its convs, KDA, Mamba 2's SSD, a short conv."""


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_hybrid_answers_as_transformers(kind, tiny_model_dir, hf_model):
    from tests.helpers import random_prompts
    from tests.test_families import LOGPROB_TOL, hf_greedy_logprobs
    from tests.test_state_cache import _greedy, _llm
    from tests.tiny_models import VOCAB_SIZE

    path = tiny_model_dir(kind)
    system = random_prompts([22], VOCAB_SIZE, seed=41)[0]
    tails = random_prompts([5, 3, 6], VOCAB_SIZE, seed=42)
    prompts = [system + t for t in tails]
    hf = hf_model(path)
    llm = _llm(path)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_lps = hf_greedy_logprobs(hf, prompt, 6)
        tokens, lps = _greedy(llm, [prompt], 6)
        assert tokens[0] == ref_tokens, f"{kind}: prompt {i} differs"
        err = max(abs(a - b) for a, b in zip(lps[0], ref_lps, strict=True))
        assert err < LOGPROB_TOL, f"{kind}: prompt {i} logprob error {err:.2e}"
    assert llm.stats()["state_prefix_hits"] == 1  # the third prompt


def _loads_ignored(monkeypatch) -> None:
    """A resumed request starts from whatever its slot held, not the kept state."""
    import warmboot.device.runner as runner_module

    prepare = runner_module.prepare_states
    monkeypatch.setattr(
        runner_module, "prepare_states", lambda s, m, u: prepare(s, replace(m, load=[]), u)
    )


def _midway_saves_skipped(monkeypatch) -> None:
    """States kept only at a row's end: a boundary inside a prefill chunk keeps nothing."""
    from warmboot.device.inputs import InputBuilder

    build = InputBuilder._state_slots

    def no_midway(self, meta, *args):
        moves = build(self, meta, *args)
        meta.state_saves = []
        return moves

    monkeypatch.setattr(InputBuilder, "_state_slots", no_midway)


@pytest.mark.parametrize("fault", [_loads_ignored, _midway_saves_skipped])
def test_the_resume_check_fails_when_a_kept_state_is_lost(fault, monkeypatch, tiny_model_dir):
    """The comparison above sees each fault (the third prompt resumes from a state kept midway
    through the second's second chunk)."""
    from tests.helpers import random_prompts
    from tests.test_families import LOGPROB_TOL
    from tests.test_state_cache import _greedy, _llm
    from tests.tiny_models import VOCAB_SIZE

    path = tiny_model_dir("qwen3_5")
    system = random_prompts([22], VOCAB_SIZE, seed=41)[0]
    prompts = [system + t for t in random_prompts([5, 3, 6], VOCAB_SIZE, seed=42)]
    want = [_greedy(_llm(path, state_checkpoints=0), [p], 6) for p in prompts]
    fault(monkeypatch)
    llm = _llm(path)
    got = [_greedy(llm, [p], 6) for p in prompts]
    pairs = zip(got, want, strict=True)
    errors = [max(abs(a - b) for a, b in zip(g[1][0], w[1][0], strict=True)) for g, w in pairs]
    assert max(errors[:2]) < LOGPROB_TOL, "the first two prompts compute in full, as without"
    assert got[2][0] != want[2][0] or errors[2] > LOGPROB_TOL, f"{fault.__name__} unnoticed"


def test_kept_states_outlive_a_kv_pool_resize(tiny_model_dir):
    """A process checkpoint shrinks the KV pool and grows it back: the rows stay."""
    from tests.test_state_cache import _llm

    llm = _llm(tiny_model_dir("qwen3_5"))
    before = llm.stats()["state_checkpoints_total"]
    llm.engine.resize_kv_cache(40)
    stats = llm.stats()
    assert stats["state_checkpoints_total"] == before > 0 and stats["prefix_caching_off"] is None
