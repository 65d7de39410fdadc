"""Scheduler: FCFS continuous batching, chunked prefill, preemption, n > 1 siblings, stops, aborts.

Driven by a fake, deterministic runner: no model, no torch. The runner also simulates the KV
cache (``(block, slot) -> (token, position)``) so that every step proves the rows read exactly
the KV their context needs (prefix hits, recompute after preemption) and never write into a
block another row can read.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections import defaultdict, deque
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmboot.config import SchedulerConfig
from warmboot.core.block_manager import BlockManager
from warmboot.core.request import FinishReason, Request, RequestStatus
from warmboot.core.scheduler import Scheduler
from warmboot.core.types import RunnerOutput, SchedulerOutput
from warmboot.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50  # the fake runner samples tokens 1..VOCAB
EOS = 0  # never sampled unless a test forces it
STOP_A, STOP_B = 101, 102  # stop token ids outside the fake vocabulary


def fake_token(req_id: str, pos: int) -> int:
    """The token sampled for ``req_id`` at position ``pos``: deterministic, never EOS."""
    return zlib.crc32(f"{req_id}@{pos}".encode()) % VOCAB + 1


def reference_output(req: Request) -> list[int]:
    p = len(req.prompt_token_ids)
    return [fake_token(req.request_id, p + k) for k in range(req.max_tokens)]


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    *,
    leader: Request | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = [(zlib.crc32(f"{req_id}#{i}".encode()) % VOCAB) + 1 for i in range(prompt)]
    params.setdefault("ignore_eos", True)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        leader=leader,
    )


class FakeRunner:
    """Returns a token for each sampling row and checks the step against a simulated KV cache.

    Steps execute in launch order (like a device stream). A ``device_fed`` row's last input is
    the token this runner sampled for that position in an earlier, not yet committed step.
    """

    def __init__(
        self,
        block_size: int,
        forced: dict[tuple[str, int], int] | None = None,
        honor_suppress: bool = True,
    ):
        self.bs = block_size
        self.honor_suppress = honor_suppress
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.forced = forced or {}  # (req_id, output index) -> token
        self.sampled: dict[tuple[str, int], int] = {}  # (req_id, position) -> token
        self.steps: list[SchedulerOutput] = []

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        bs, writes = self.bs, {}
        for s in out.scheduled:
            end = s.start_pos + s.num_tokens
            # NOTE: the output so far is what this runner sampled (committed or still in flight)
            context = list(s.prompt_token_ids)
            context += [self.sampled[(s.req_id, p)] for p in range(len(context), end)]
            tokens = list(s.token_ids)
            if s.device_fed:
                assert tokens[-1] == -1
                tokens[-1] = self.sampled[(s.req_id, end - 1)]
            assert tokens == context[s.start_pos : end]
            for pos in range(s.start_pos):  # the KV this row attends to is all there
                slot = (s.block_table[pos // bs], pos % bs)
                assert self.kv.get(slot) == (context[pos], pos), (s.req_id, pos)
            for i, token in enumerate(tokens):
                pos = s.start_pos + i
                slot = (s.block_table[pos // bs], pos % bs)
                assert slot not in writes, f"two rows write KV slot {slot} in one step"
                writes[slot] = (token, pos)
        self.kv.update(writes)
        req_ids, tokens = [], []
        for s in out.scheduled:
            if not s.sample:
                continue
            pos = s.start_pos + s.num_tokens
            token = self.forced.get((s.req_id, pos - len(s.prompt_token_ids)))
            if token is None or (self.honor_suppress and token in s.suppress_token_ids):
                token = fake_token(s.req_id, pos)
                assert token not in s.suppress_token_ids
            self.sampled[(s.req_id, pos)] = token
            req_ids.append(s.req_id)
            tokens.append(token)
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=tokens)


def snapshot_requests(sched: Scheduler) -> dict[str, tuple[RequestStatus, int, int]]:
    """Per request: status, computed tokens and context length (known + in flight)."""
    return {
        rid: (r.status, r.num_computed_tokens, r.num_tokens) for rid, r in sched.requests.items()
    }


def check_step(
    sched: Scheduler,
    out: SchedulerOutput,
    before: dict[str, tuple[RequestStatus, int, int]],
    pipelined: bool = False,
) -> None:
    """Everything one scheduled step must satisfy, checked against the scheduler's requests.

    ``before`` is ``snapshot_requests`` taken just before ``schedule()``. Unless ``pipelined``
    the previous step was committed (``update``) before this ``schedule()``: every token is known.
    """
    cfg, kv = sched.config, sched.kv
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [s.req_id for s in out.scheduled]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & set(out.preempted_req_ids)
    for s in out.scheduled:
        req = sched.requests[s.req_id]
        assert req.status is RequestStatus.RUNNING and req in sched.running
        assert s.num_tokens >= 1
        status, computed, context = before[s.req_id]
        end = s.start_pos + s.num_tokens
        if status is RequestStatus.RUNNING:
            assert s.start_pos == computed  # a running request continues where it stopped
        else:  # (re)admitted: from the start or after a prefix hit of full blocks
            assert s.start_pos % kv.block_size == 0 and s.start_pos < context
        known = s.token_ids
        if getattr(s, "device_fed", False):
            assert pipelined and end == context == len(req.all_token_ids) + 1
            known = s.token_ids[:-1]
        assert known == req.all_token_ids[s.start_pos : s.start_pos + len(known)]
        assert s.block_table == kv.block_table(s.req_id)
        assert len(s.block_table) == kv.blocks_needed(end)
        assert end <= context and s.sample == (end == context)
        # a row is only launched while an output is still due (none past max_tokens)
        assert context - req.num_prompt_tokens < req.max_tokens
        assert s.params is req.params
    for rid in out.preempted_req_ids:
        req = sched.requests[rid]
        assert before[rid][0] is RequestStatus.RUNNING
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        assert kv.block_table(rid) == []


def check_cache_matches_kv(kv: BlockManager, runner: FakeRunner) -> None:
    """Every block in the prefix cache holds, in the simulated KV, exactly its recorded tokens."""
    for block in kv.blocks:
        if block.block_hash is not None:
            assert len(block.token_ids) == kv.block_size
            held = tuple(
                runner.kv.get((block.block_id, j), (None,))[0] for j in range(kv.block_size)
            )
            assert held == block.token_ids, f"cached block {block.block_id} holds other tokens"


class Driver:
    """Runs schedule -> fake runner -> update, checking every step."""

    def __init__(
        self,
        *,
        num_blocks: int = 1000,
        block_size: int = 4,
        budget: int = 2048,
        max_num_seqs: int = 64,
        caching: bool = True,
        forced: dict[tuple[str, int], int] | None = None,
        honor_suppress: bool = True,
    ):
        self.kv = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), self.kv
        )
        self.runner = FakeRunner(block_size, forced, honor_suppress)
        self.outs: list[SchedulerOutput] = []
        self.events = []
        self.finished_reported: list[str] = []

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add_request(r)

    def step(self) -> SchedulerOutput:
        before = snapshot_requests(self.sched)
        out = self.sched.schedule()
        check_step(self.sched, out, before)
        self.finished_reported += out.finished_req_ids
        self.outs.append(out)
        result = self.runner(out)
        self.events += self.sched.update(out, result)
        self.kv.check_invariants()
        check_cache_matches_kv(self.kv, self.runner)
        return out

    def launch(self) -> tuple[SchedulerOutput, RunnerOutput, list[int]]:
        """Pipelined: schedule and run a step; it holds its blocks until it is committed."""
        before = snapshot_requests(self.sched)
        out = self.sched.schedule()
        check_step(self.sched, out, before, pipelined=True)
        self.finished_reported += out.finished_req_ids
        self.outs.append(out)
        held = [b for s in out.scheduled for b in s.block_table]
        self.kv.hold(held)
        result = self.runner(out)
        self.kv.check_invariants()
        return out, result, held

    def commit(self, handle: tuple[SchedulerOutput, RunnerOutput, list[int]]) -> None:
        out, result, held = handle
        self.events += self.sched.update(out, result)
        self.kv.unhold(held)
        self.kv.check_invariants()
        check_cache_matches_kv(self.kv, self.runner)

    def run_pipelined(self, max_steps: int = 10_000) -> None:
        in_flight: deque = deque()
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or in_flight):
                return
            if self.sched.has_unfinished():
                in_flight.append(self.launch())
            while len(in_flight) > 1 or (in_flight and not self.sched.has_unfinished()):
                self.commit(in_flight.popleft())
        raise AssertionError("did not finish")

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            out = self.step()
            assert not out.is_empty, "empty step with unfinished requests"
        raise AssertionError("did not finish")

    def rows(self, req_id: str):
        """(step index, row) for each step that scheduled ``req_id``."""
        return [(i, s) for i, o in enumerate(self.outs) for s in o.scheduled if s.req_id == req_id]


# -- torch-free -------------------------------------------------------------------------------
def _imports(code: str, module: str = "torch") -> bool:
    probe = code + f"\nimport sys\nprint({module!r} in sys.modules)\n"
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1] == "True"


def test_import_scheduler_does_not_import_torch():
    code = (
        "import warmboot.core.scheduler, warmboot.core.block_manager, warmboot.core.request\n"
        "import warmboot.config, warmboot.sampling_params\n"
    )
    assert not _imports(code)
    # the probe does detect an imported module
    assert not _imports(code, "xml.dom")
    assert _imports(code + "import xml.dom\n", "xml.dom")


# -- step shape -------------------------------------------------------------------------------
def test_step_rows_are_consistent_and_respect_limits():
    d = Driver(block_size=4, budget=10, max_num_seqs=3)
    reqs = [make_request(f"r{i}", 3 + 7 * i, max_tokens=5) for i in range(5)]
    d.add(*reqs)
    d.run()
    assert max(o.num_batched_tokens for o in d.outs) == 10  # the budget was the limit
    assert max(len(o.scheduled) for o in d.outs) == 3  # and so was max_num_seqs
    for r in reqs:
        assert r.output_token_ids == reference_output(r)
        assert r.finish_reason is FinishReason.LENGTH
        rows = [s for _, s in d.rows(r.request_id)]
        # chunks are contiguous; exactly the chunks that reach the end sample
        assert rows[0].start_pos == 0
        for a, b in zip(rows, rows[1:], strict=False):
            assert b.start_pos == a.start_pos + a.num_tokens
        assert sum(s.sample for s in rows) == r.max_tokens
        prompt_rows = [s for s in rows if s.start_pos < r.num_prompt_tokens]
        assert [s.sample for s in prompt_rows] == [False] * (len(prompt_rows) - 1) + [True]
    assert d.kv.num_used_blocks == 0
    assert sorted(d.finished_reported + d.sched.schedule().finished_req_ids) == sorted(
        r.request_id for r in reqs
    )


def test_chunked_prefill_mixed_with_decodes():
    d = Driver(block_size=4, budget=8)
    short = make_request("short", 3, max_tokens=12)
    long = make_request("long", 30, max_tokens=2)
    d.add(short)
    d.step()
    d.step()  # "short" is decoding
    d.add(long)
    d.run()
    rows = d.rows("long")
    prefill = [(i, s) for i, s in rows if s.start_pos < 30]
    assert len(prefill) >= 4  # 30 tokens, at most 7 per step next to a decode
    assert sum(s.num_tokens for _, s in prefill) == 30
    assert all(s.num_tokens <= 7 for _, s in prefill)
    assert [s.sample for _, s in prefill] == [False] * (len(prefill) - 1) + [True]
    mixed = 0
    for i, _ in prefill:
        others = [o for o in d.outs[i].scheduled if o.req_id == "short"]
        if others:
            (dec,) = others
            assert dec.num_tokens == 1 and dec.sample
            mixed += 1
    assert mixed == len(prefill)  # every prefill chunk ran next to a decode
    assert short.output_token_ids == reference_output(short)
    assert long.output_token_ids == reference_output(long)


def test_budget_one_serves_one_token_per_step():
    d = Driver(block_size=2, budget=1)
    a, b = make_request("a", 3, max_tokens=2), make_request("b", 2, max_tokens=2)
    d.add(a, b)
    d.run()
    assert all(o.num_batched_tokens == 1 for o in d.outs)
    assert len(d.outs) == (3 + 1) + (2 + 1)
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b)


# -- FCFS -------------------------------------------------------------------------------------
def _first_steps(d: Driver) -> list[str]:
    order: list[str] = []
    for o in d.outs:
        for s in o.scheduled:
            if s.req_id not in order:
                order.append(s.req_id)
    return order


def test_fcfs_start_order():
    d = Driver(block_size=4, budget=6, max_num_seqs=2)
    reqs = [make_request(f"r{i}", [5, 6, 7, 8, 9][: 1 + i % 5] * 3, max_tokens=3) for i in range(7)]
    d.add(*reqs)
    d.run()
    assert _first_steps(d) == [r.request_id for r in reqs]


def test_fcfs_head_blocked_by_pool_is_not_overtaken():
    # the head needs 3 blocks while only 2 are free; the small one behind it must wait too
    d = Driver(num_blocks=4, block_size=4, budget=64)
    running = make_request("running", 7, max_tokens=2)
    d.add(running)
    d.step()
    big, small = make_request("big", 12, max_tokens=1), make_request("small", 1, max_tokens=1)
    d.add(big, small)
    out = d.step()
    assert [s.req_id for s in out.scheduled] == ["running"]
    d.run()
    assert _first_steps(d) == ["running", "big", "small"]


# -- preemption -------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_recomputes_most_recent_request(caching):
    bs = 4
    reqs = [make_request(f"r{i}", 6, max_tokens=10) for i in range(3)]
    # each needs ceil((6 + 10 - 1) / 4) = 4 blocks alone; three of them start with 2 each
    d = Driver(num_blocks=7, block_size=bs, caching=caching)
    d.add(*reqs)
    d.run()
    preempted = [rid for o in d.outs for rid in o.preempted_req_ids]
    assert preempted, "the pool was too small: a preemption must happen"
    assert preempted[0] == "r2"  # the most recently admitted one goes first
    first = next(i for i, o in enumerate(d.outs) if o.preempted_req_ids)
    assert d.sched.num_preemptions == len(preempted)
    assert reqs[2].num_preemptions >= 1

    # r2 is later rescheduled and recomputes its prompt plus the outputs it had
    had = [s for i, s in d.rows("r2") if i < first][-1]  # its last row before the preemption
    context_then = had.start_pos + had.num_tokens + 1  # the token sampled then
    rerows = [s for i, s in d.rows("r2") if i > first]
    if not caching:
        assert rerows[0].start_pos == 0
    assert rerows[0].start_pos % bs == 0
    assert rerows[0].start_pos + rerows[0].num_tokens == context_then
    assert rerows[0].token_ids[-1] == reqs[2].output_token_ids[context_then - 6 - 1]
    assert rerows[0].sample

    for r in reqs:
        assert r.output_token_ids == reference_output(r)
        assert len(r.output_token_ids) == r.max_tokens
        assert r.finish_reason is FinishReason.LENGTH
        # num_cached_tokens is recorded at the first admission only
        assert r.num_cached_tokens == 0
    assert d.kv.num_used_blocks == 0

    # the same workload with a huge pool: no preemption and the same outputs
    ref = Driver(block_size=bs, caching=caching)
    ref_reqs = [make_request(f"r{i}", 6, max_tokens=10) for i in range(3)]
    ref.add(*ref_reqs)
    ref.run()
    assert ref.sched.num_preemptions == 0
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref_reqs]


def test_preempted_request_requeues_at_the_front():
    d = Driver(num_blocks=4, block_size=2, budget=64)
    a, b = make_request("a", 3, max_tokens=5), make_request("b", 3, max_tokens=5)
    d.add(a, b)
    d.step()  # both admitted: 2 blocks each, pool full
    d.step()  # context 4: still 2 blocks each
    c = make_request("c", 1, max_tokens=1)
    d.add(c)
    out = d.step()  # context 5: a needs a third block, b is preempted
    assert out.preempted_req_ids == ["b"]
    assert [s.req_id for s in out.scheduled] == ["a"]  # no admission in a preempting step
    assert list(d.sched.waiting) == [b, c]
    assert b.status is RequestStatus.WAITING and d.kv.block_table("b") == []
    d.run()
    assert _first_steps(d) == ["a", "b", "c"]
    for r in (a, b, c):
        assert r.output_token_ids == reference_output(r)


def test_preempted_request_readmits_with_its_cached_prefix():
    d = Driver(num_blocks=5, block_size=2, budget=64)
    a, b = make_request("a", 3, max_tokens=3), make_request("b", 5, max_tokens=4)
    d.add(a, b)
    d.step()  # a: 2 blocks, b: 3 blocks, pool full
    d.step()  # a context 4 -> 5, b context 6 -> 7: no new block yet
    out = d.step()  # a needs a third block: b (6 computed, 3 full cached blocks) is preempted
    assert out.preempted_req_ids == ["b"]
    assert a.is_finished  # ... and a finishes in that step
    out = d.step()
    (row,) = out.scheduled
    assert row.req_id == "b"
    # one of b's cached blocks was evicted for a; the other two are a prefix hit
    assert row.start_pos == 4 and row.token_ids == b.all_token_ids[4:7]
    assert row.sample
    assert b.num_cached_tokens == 0  # recorded at the first admission only
    d.run()
    assert b.output_token_ids == reference_output(b)


def test_only_running_request_that_cannot_fit_is_preempted_not_stuck():
    # a pool too small for one request: the scheduler preempts it rather than overcommit
    d = Driver(num_blocks=2, block_size=2)
    r = make_request("r", 3, max_tokens=5)
    d.add(r)
    d.step()
    d.step()  # context 4 -> 5 needs a third block
    out = d.step()
    assert out.preempted_req_ids == ["r"] and out.is_empty
    d.kv.check_invariants()
    assert d.kv.num_used_blocks == 0


# -- n > 1 siblings ---------------------------------------------------------------------------
def test_siblings_wait_for_leader_prompt_then_hit_prefix():
    bs = 4
    d = Driver(block_size=bs, budget=4)
    prompt = list(range(1, 11))  # 10 tokens: 3 steps of prefill at 4 tokens per step
    leader = make_request("L", prompt, max_tokens=3)
    sibs = [make_request(f"S{i}", prompt, max_tokens=3, leader=leader) for i in range(2)]
    other = make_request("X", 2, max_tokens=1)
    d.add(leader, *sibs, other)
    d.run()
    lrows = d.rows("L")
    prompt_done = next(i for i, s in lrows if s.start_pos + s.num_tokens == 10)
    assert prompt_done == 2
    for sib in sibs:
        srows = d.rows(sib.request_id)
        assert srows[0][0] > prompt_done
        first = srows[0][1]
        assert first.start_pos == 8 and sib.num_cached_tokens == 8
        ltable = next(s for i, s in lrows if i == prompt_done).block_table
        assert len(ltable) == 3 and first.block_table[:2] == ltable[:2]
        assert sib.output_token_ids == reference_output(sib)
    # the unrelated request behind the siblings is not held up by them
    assert d.rows("X")[0][0] < d.rows("S0")[0][0]
    assert d.kv.prefix_hits >= 2


def test_siblings_keep_their_place_in_the_queue():
    # while a sibling waits for its leader it stays ahead of requests that arrived after it
    d = Driver(num_blocks=11, block_size=1, budget=6)
    prompt = [4, 4, 2, 2, 5, 5, 1, 1]
    leader = make_request("L", prompt, max_tokens=3)
    sib = make_request("S", prompt, max_tokens=3, leader=leader)
    later = make_request("X", 10, max_tokens=1)
    d.add(leader, sib, later)
    d.step()  # L: 6 prompt tokens
    out = d.step()  # L: the last 2; S is skipped, X's first chunk (4 blocks) does not fit
    assert [s.req_id for s in out.scheduled] == ["L"]
    assert list(d.sched.waiting) == [sib, later]
    out = d.step()  # S now shares 7 of L's blocks and needs only 1 new one; X still waits
    assert [s.req_id for s in out.scheduled] == ["L", "S"]
    assert out.scheduled[1].start_pos == 7
    d.run()
    for r in (leader, sib, later):
        assert r.output_token_ids == reference_output(r)


def test_siblings_share_the_leader_blocks():
    d = Driver(block_size=2, budget=64)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    leader = make_request("L", prompt, max_tokens=2)
    sib = make_request("S", prompt, max_tokens=2, leader=leader)
    d.add(leader, sib)
    out = d.step()
    assert [s.req_id for s in out.scheduled] == ["L"]
    out = d.step()
    rows = {s.req_id: s for s in out.scheduled}
    assert rows["S"].start_pos == 6
    assert rows["S"].block_table[:3] == rows["L"].block_table[:3]
    assert rows["S"].block_table[3] != rows["L"].block_table[3]
    d.run()


def test_siblings_do_not_wait_without_prefix_caching_or_after_leader_abort():
    d = Driver(block_size=2, budget=64, caching=False)
    leader = make_request("L", 5, max_tokens=2)
    sib = make_request("S", leader.prompt_token_ids, max_tokens=2, leader=leader)
    d.add(leader, sib)
    out = d.step()
    assert {s.req_id for s in out.scheduled} == {"L", "S"}
    d.run()

    d = Driver(block_size=2, budget=2)
    leader = make_request("L", 5, max_tokens=2)
    sib = make_request("S", leader.prompt_token_ids, max_tokens=2, leader=leader)
    d.add(leader, sib)
    d.step()
    d.sched.finish_requests(["L"], FinishReason.ABORT)
    out = d.step()
    assert [s.req_id for s in out.scheduled] == ["S"]
    d.run()
    assert sib.output_token_ids == reference_output(sib)


# -- stops ------------------------------------------------------------------------------------
def _run_one(req: Request, forced: dict[int, int], budget: int = 2048) -> Driver:
    d = Driver(
        block_size=4, budget=budget, forced={(req.request_id, k): t for k, t in forced.items()}
    )
    d.add(req)
    d.run()
    return d


def test_eos_stops_unless_ignored():
    r = make_request("r", 5, max_tokens=8, ignore_eos=False)
    d = _run_one(r, {2: EOS})
    assert r.output_token_ids == reference_output(r)[:2] + [EOS]
    assert r.finish_reason is FinishReason.STOP and r.stop_reason is None
    assert d.events[-1].finished and d.events[-1].new_token_ids == [EOS]
    assert not any(e.finished for e in d.events[:-1])

    r = make_request("r", 5, max_tokens=8, ignore_eos=True)
    _run_one(r, {2: EOS})
    assert len(r.output_token_ids) == 8 and r.output_token_ids[2] == EOS
    assert r.finish_reason is FinishReason.LENGTH


def test_eos_on_the_last_token_is_a_stop():
    r = make_request("r", 5, max_tokens=3, ignore_eos=False)
    _run_one(r, {2: EOS})
    assert r.finish_reason is FinishReason.STOP and len(r.output_token_ids) == 3


def test_stop_token_ids_set_stop_reason():
    for ignore_eos in (False, True):
        r = make_request(
            "r", 5, max_tokens=8, ignore_eos=ignore_eos, stop_token_ids=[STOP_A, STOP_B]
        )
        _run_one(r, {1: STOP_B, 3: STOP_A})
        assert r.output_token_ids == reference_output(r)[:1] + [STOP_B]
        assert r.finish_reason is FinishReason.STOP and r.stop_reason == STOP_B


def test_min_tokens_suppresses_eos_and_stop_ids():
    r = make_request("r", 5, max_tokens=8, ignore_eos=False, min_tokens=3, stop_token_ids=[STOP_A])
    d = _run_one(r, {0: EOS, 1: STOP_A, 2: EOS, 3: EOS}, budget=2)
    sample_rows = [s for _, s in d.rows("r") if s.sample]
    for k, s in enumerate(sample_rows):
        if k < 3:
            assert sorted(s.suppress_token_ids) == [EOS, STOP_A]
        else:
            assert s.suppress_token_ids == ()
    prefill = [s for _, s in d.rows("r") if not s.sample]
    assert len(prefill) == 2 and all(s.suppress_token_ids == () for s in prefill)
    assert r.output_token_ids[:3] == reference_output(r)[:3]
    assert r.output_token_ids[3] == EOS and len(r.output_token_ids) == 4
    assert r.finish_reason is FinishReason.STOP


def test_min_tokens_is_enforced_even_if_the_sampler_emits_a_stop():
    # a sampler that ignores suppress_token_ids: the scheduler still must not stop early
    r = make_request("r", 5, max_tokens=8, ignore_eos=False, min_tokens=3, stop_token_ids=[STOP_A])
    d = Driver(block_size=4, honor_suppress=False)
    d.runner.forced = {("r", 0): EOS, ("r", 1): STOP_A, ("r", 2): EOS, ("r", 3): STOP_A}
    d.add(r)
    d.run()
    assert r.output_token_ids == [EOS, STOP_A, EOS, STOP_A]
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == STOP_A


def test_min_tokens_with_ignore_eos_suppresses_only_stop_ids():
    r = make_request("r", 3, max_tokens=4, ignore_eos=True, min_tokens=2, stop_token_ids=[STOP_A])
    d = _run_one(r, {0: STOP_A, 2: EOS})
    rows = [s for _, s in d.rows("r") if s.sample]
    assert [s.suppress_token_ids for s in rows] == [(STOP_A,), (STOP_A,), (), ()]
    assert r.output_token_ids[0] != STOP_A and r.output_token_ids[2] == EOS
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 4


def test_no_suppression_without_min_tokens():
    r = make_request("r", 3, max_tokens=3, ignore_eos=False, stop_token_ids=[STOP_A])
    d = _run_one(r, {})
    assert all(s.suppress_token_ids == () for _, s in d.rows("r"))


def test_pipelined_stops_and_min_tokens():
    """Step t+1 is launched before step t is committed: stops still land exactly."""
    d = Driver(block_size=2)
    eos = make_request("eos", 3, max_tokens=9, ignore_eos=False)
    mn = make_request("min", 4, max_tokens=9, ignore_eos=False, min_tokens=2)
    length = make_request("len", 5, max_tokens=3, ignore_eos=False)
    forced = {("eos", 2): EOS, ("min", 0): EOS, ("min", 1): EOS, ("min", 2): EOS}
    d.runner.forced = forced
    d.add(eos, mn, length)
    d.run_pipelined()
    assert eos.output_token_ids == reference_output(eos)[:2] + [EOS]
    assert mn.output_token_ids == reference_output(mn)[:2] + [EOS]
    assert length.output_token_ids == reference_output(length)
    assert [r.finish_reason for r in (eos, mn, length)] == [
        FinishReason.STOP,
        FinishReason.STOP,
        FinishReason.LENGTH,
    ]
    # rows sampling output k of "min" suppress EOS exactly while k < min_tokens
    for s in (s for o in d.outs for s in o.scheduled if s.req_id == "min" and s.sample):
        k = s.start_pos + s.num_tokens - mn.num_prompt_tokens
        assert s.suppress_token_ids == ((EOS,) if k < 2 else ())
    # the pipeline did overlap: some rows read their last input on the device
    assert any(getattr(s, "device_fed", False) for o in d.outs for s in o.scheduled)
    assert d.kv.num_held_blocks == 0 and d.kv.num_used_blocks == 0
    flushed = d.sched.schedule().finished_req_ids
    assert sorted(d.finished_reported + flushed) == ["eos", "len", "min"]


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(max_tokens):
    r = make_request("r", 9, max_tokens=max_tokens, ignore_eos=False)
    d = _run_one(r, {})
    assert r.output_token_ids == reference_output(r)
    assert r.finish_reason is FinishReason.LENGTH and r.is_finished
    assert [e.finished for e in d.events] == [False] * (max_tokens - 1) + [True]


# -- finish_requests (abort) ------------------------------------------------------------------
def test_abort_waiting_and_running_requests_frees_blocks():
    d = Driver(block_size=2, budget=64, max_num_seqs=1)
    a, b = make_request("a", 5, max_tokens=9), make_request("b", 4, max_tokens=3)
    d.add(a, b)
    d.step()
    assert d.kv.num_used_blocks == 3 and b.status is RequestStatus.WAITING
    d.sched.finish_requests(["b"], FinishReason.ABORT)
    assert b.is_finished and b.finish_reason is FinishReason.ABORT
    assert not d.sched.waiting and "b" not in d.sched.requests
    d.kv.check_invariants()
    out = d.step()
    assert out.finished_req_ids == ["b"]
    d.sched.finish_requests(["a", "unknown", "b"], FinishReason.ABORT)
    assert a.finish_reason is FinishReason.ABORT and not d.sched.running
    assert not d.sched.has_unfinished()
    d.kv.check_invariants()
    assert d.kv.num_used_blocks == 0
    out = d.sched.schedule()
    assert out.is_empty and out.finished_req_ids == ["a"]
    assert d.sched.schedule().finished_req_ids == []
    # the request ids can be used again
    d.add(make_request("a", 3, max_tokens=1))
    d.run()


def test_abort_between_schedule_and_update():
    d = Driver(block_size=2, budget=64)
    a, b = make_request("a", 5, max_tokens=4), make_request("b", 5, max_tokens=4)
    d.add(a, b)
    d.step()
    before = snapshot_requests(d.sched)
    out = d.sched.schedule()
    check_step(d.sched, out, before)
    d.sched.finish_requests(["a"], FinishReason.ABORT)
    result = d.runner(out)
    events = d.sched.update(out, result)
    assert [e.req_id for e in events] == ["b"]
    assert len(a.output_token_ids) == 1 and a.finish_reason is FinishReason.ABORT
    d.kv.check_invariants()
    assert d.kv.block_table("a") == []
    d.run()
    assert d.kv.num_used_blocks == 0
    assert b.output_token_ids == reference_output(b)


def test_finished_ids_reported_once():
    d = Driver(block_size=2, budget=64)
    reqs = [make_request(f"r{i}", 3, max_tokens=1 + i) for i in range(3)]
    d.add(*reqs)
    d.run()
    flushed = d.sched.schedule().finished_req_ids
    reported = d.finished_reported + flushed
    assert sorted(reported) == ["r0", "r1", "r2"]
    # each is reported in the step right after the one that finished it
    assert d.outs[1].finished_req_ids == ["r0"]
    assert d.outs[2].finished_req_ids == ["r1"]
    assert flushed == ["r2"]


def test_duplicate_request_id_rejected():
    d = Driver()
    d.add(make_request("a", 3))
    with pytest.raises(ValueError):
        d.add(make_request("a", 3))


# -- property test ----------------------------------------------------------------------------
BASES = ([1, 2, 3, 1, 2, 3, 4, 5] * 8, [2, 2, 1, 1] * 16)


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        arrival = draw(st.integers(0, 8))
        if reqs and draw(st.integers(0, 4)) == 0:
            # an n > 1 sibling of an earlier request arriving with it
            lead = draw(st.sampled_from(reqs))
            while lead["leader"] is not None:
                lead = reqs[lead["leader"]]
            reqs.append(
                dict(
                    lead,
                    id=f"q{i}",
                    leader=reqs.index(lead),
                    max_tokens=draw(st.integers(1, 20)),
                )
            )
            continue
        n = draw(st.integers(1, 60))
        kind = draw(st.integers(0, 2))
        if kind < 2:  # a shared base with a random tail, so prefixes repeat
            cut = draw(st.integers(0, n))
            tail = draw(st.lists(st.integers(1, 5), min_size=n - cut, max_size=n - cut))
            prompt = BASES[kind][:cut] + tail
        else:
            prompt = draw(st.lists(st.integers(1, VOCAB), min_size=n, max_size=n))
        reqs.append(
            dict(
                id=f"q{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 20)),
                arrival=arrival,
                leader=None,
            )
        )
    need = max(-(-(len(r["prompt"]) + r["max_tokens"] - 1) // bs) for r in reqs)
    num_blocks = need + draw(st.sampled_from([0, 0, 1, 2, 5, 1000]))
    budget = draw(st.integers(1, 64))
    max_num_seqs = draw(st.integers(1, 8))
    caching = draw(st.booleans())
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 40), st.sampled_from([r["id"] for r in reqs])), max_size=3
        )
    )
    return dict(
        bs=bs,
        reqs=reqs,
        num_blocks=num_blocks,
        budget=budget,
        max_num_seqs=max_num_seqs,
        caching=caching,
        aborts=aborts,
    )


def simulate(
    w, num_blocks: int, aborts, pipelined: bool = False
) -> tuple[Driver, dict[str, Request]]:
    """Run a workload; ``pipelined`` launches step t+1 before committing step t."""
    d = Driver(
        num_blocks=num_blocks,
        block_size=w["bs"],
        budget=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        caching=w["caching"],
    )
    made: list[Request] = []
    for spec in w["reqs"]:
        leader = made[spec["leader"]] if spec["leader"] is not None else None
        made.append(make_request(spec["id"], spec["prompt"], spec["max_tokens"], leader=leader))
    by_id = {r.request_id: r for r in made}
    arrivals = defaultdict(list)
    for spec, r in zip(w["reqs"], made, strict=True):
        arrivals[spec["arrival"]].append(r)
    abort_at = defaultdict(list)
    for step, rid in aborts:
        abort_at[step].append(rid)
    last_event = max([*arrivals, *abort_at])
    total_work = sum(len(r.prompt_token_ids) + r.max_tokens for r in made)
    step, in_flight = 0, deque()
    while step <= last_event or d.sched.has_unfinished() or in_flight:
        assert step <= 2 * (last_event + total_work) + 5, "no progress (livelock)"
        d.add(*arrivals.get(step, []))
        d.sched.finish_requests(
            [rid for rid in abort_at.get(step, []) if rid in d.sched.requests], FinishReason.ABORT
        )
        if not pipelined:
            if d.sched.has_unfinished():
                out = d.step()
                assert not out.is_empty, "empty step while requests wait"
        else:
            if d.sched.has_unfinished():
                in_flight.append(d.launch())
            while len(in_flight) > 1 or (in_flight and not d.sched.has_unfinished()):
                d.commit(in_flight.popleft())
        step += 1
    return d, by_id


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(w=workloads())
def test_random_workloads(w):
    check_workload(w, pipelined=False)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(w=workloads())
def test_random_workloads_pipelined(w):
    """Step t+1 is scheduled before step t is committed, its blocks held while in flight."""
    check_workload(w, pipelined=True)


def check_workload(w, pipelined: bool) -> None:
    d, reqs = simulate(w, w["num_blocks"], w["aborts"], pipelined)
    assert not d.sched.has_unfinished() and not d.sched.requests
    assert d.kv.num_held_blocks == 0
    assert d.kv.num_used_blocks == 0
    reported = d.finished_reported + d.sched.schedule().finished_req_ids
    assert sorted(reported) == sorted(reqs)

    huge = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // w["bs"]) for r in w["reqs"])
    ref, ref_reqs = simulate(w, huge, [])
    assert ref.sched.num_preemptions == 0
    aborted = {rid for _, rid in w["aborts"]}
    for rid, r in reqs.items():
        want = ref_reqs[rid].output_token_ids
        assert want == reference_output(r)
        if r.finish_reason is FinishReason.ABORT:
            assert rid in aborted
            assert r.output_token_ids == want[: len(r.output_token_ids)]
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert r.output_token_ids == want

    # FCFS among requests without a leader: they start in arrival order
    order = {s.req_id: i for i, o in reversed(list(enumerate(d.outs))) for s in o.scheduled}
    started = sorted(
        (spec["arrival"], k, spec["id"])
        for k, spec in enumerate(w["reqs"])
        if spec["leader"] is None and spec["id"] in order
    )
    firsts = [order[rid] for _, _, rid in started]
    assert firsts == sorted(firsts)
