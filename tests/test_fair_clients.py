"""Clients in turn (``core.fair_queue``) and steps sized by time (``core.step_cost``,
``max_step_ms``): one client's flood of calls delays that client only, a step's budget follows
the fitted step cost, and running prefills leave room for a newcomer. On the scheduler with
the fake runner of ``test_scheduler``; counted in steps and budget units, never in seconds.
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.helpers import random_prompts
from tests.test_fair_scheduling import (
    _one_thread,  # noqa: F401 - the engine tests' fixture
    call,
    check_outputs,
    drain,
    driver,
    make_engine,
    steps_to_first_token,
)
from tests.test_scheduler import make_request
from tests.tiny_models import VOCAB_SIZE
from warmboot.core import scheduler as scheduler_mod
from warmboot.core.request import Request, RequestStatus
from warmboot.core.scheduler import EXPRESS_UNITS, MIN_PREFILL_UNITS
from warmboot.core.shared_steps import (
    MIN_UNITS,
    RECENT_S,
    RECENT_STEPS,
    SHARED_MIN_S,
    SharedSteps,
    decodes_within,
    shared_seconds,
)
from warmboot.core.step_cost import MIN_SAMPLES, StepCost
from warmboot.sampling_params import SamplingParams


def streams(client: str, count: int, **kw) -> list[Request]:
    """``count`` calls of one sequence each from ``client`` (a client's concurrent streams)."""
    reqs = [call(f"{client}{i}-", 1, 8, **kw)[0] for i in range(count)]
    for r in reqs:
        r.client = client
    return reqs


def test_a_flood_of_calls_delays_its_own_client_only():
    """256 streams of one client fill every seat but the reserve and queue the rest; another
    client's call starts in the next step; the flooding client's own new call waits."""
    d = driver(max_num_seqs=64)
    flood = streams("a", 256, max_tokens=64)
    d.add(*flood)
    for _ in range(3):
        d.step()
    assert len(d.sched.running) == 62 and len(d.sched.waiting) == 194  # 2 seats: clients'
    probe = call("probe", 1, 8, max_tokens=1)[0]
    probe.client = "b"
    assert steps_to_first_token(d, probe) == 1
    own = streams("a", 1, max_tokens=1)[0]  # named a0- again: distinct requests
    own.request_id, own.group = "a-own", "a-own"
    assert steps_to_first_token(d, own, limit=2000) > 40
    check_outputs(d, *flood, probe, own)


WAIT_ORDER = ["b0-0", "N0", "b1-0", "A1", "b2-0", "A2", "A3"]


def test_clients_take_turns_then_their_calls():
    d = driver(max_num_seqs=1, reserved_seats=0, max_num_batched_tokens=64)
    a_big = call("A", 4, 4, max_tokens=1)
    b = streams("b", 3, max_tokens=1)
    for r in a_big:
        r.client = "a"
    d.add(*a_big)
    d.step()
    a_new = call("N", 1, 4, max_tokens=1)[0]
    a_new.client = "a"
    d.add(*b, a_new)
    assert [r.request_id for r in d.sched.waiting] == WAIT_ORDER
    check_outputs(d, *a_big, *b, a_new)
    # each round one sequence of each client; within client a, its new call before its backlog
    order = [s.req_id for o in d.outs for s in o.scheduled if s.start_pos == 0]
    assert order == ["A0", *WAIT_ORDER]


def test_aborting_a_waiting_request_gives_back_its_clients_latest_slot():
    d = driver(max_num_seqs=1, reserved_seats=0)
    a = streams("a", 3, max_tokens=2)
    b = streams("b", 2, max_tokens=2)
    d.add(*a, *b)
    d.step()
    d.sched.finish_requests(["a1-0"], reason=None)
    assert [r.request_id for r in d.sched.waiting] == ["b0-0", "a2-0", "b1-0"]
    assert len(d.sched.waiting) == 3


# -- step cost ---------------------------------------------------------------------------------
STEPS = [
    (1, 0, 10),
    (64, 4, 300),
    (0, 32, 2000),
    (128, 8, 900),
    (32, 0, 1500),
    (0, 1, 40),
    (256, 16, 4000),
    (16, 2, 3000),
]
"""(prefill units, decode rows, context tokens) of varied steps."""


def test_step_cost_fits_fixed_prefill_decode_and_context_time():
    cost = StepCost()
    assert cost.units_within(0.1) is None
    for units, rows, context in STEPS * 2:
        cost.observe(units, rows, context, 0.050 + 0.002 * units + 0.006 * rows + 1e-5 * context)
    assert cost.fit() == pytest.approx((0.050, 0.002, 0.006, 1e-5))
    assert cost.units_within(0.1) == 25
    assert cost.units_within(0.3, decode_rows=10) == 10 + 95
    assert cost.units_within(0.3, decode_rows=10, context=1000) == 10 + 90


def test_a_step_gets_prefill_worth_its_unavoidable_cost():
    """Where the fixed cost, decodes and context alone take longer than half the cap, the
    prefill gets as long again (at least half the uncapped throughput), not a sliver."""
    cost = StepCost()
    for units, rows, context in STEPS * 2:
        cost.observe(units, rows, context, 0.050 + 0.002 * units + 0.006 * rows + 1e-5 * context)
    # unavoidable: 50 + 30 + 20 = 100 ms, over the 60 ms cap: 100 ms of prefill, 50 units
    assert cost.units_within(0.06, decode_rows=5, context=2000) == 5 + 50


def test_step_cost_pools_the_terms_it_cannot_tell_apart():
    no_context = StepCost()
    for units, rows, _ in STEPS:
        no_context.observe(units, rows, 0, 0.050 + 0.002 * units + 0.006 * rows)
    assert no_context.fit() == pytest.approx((0.050, 0.002, 0.006, 0.0))
    pooled = StepCost()
    for rows in [1, 8, 32, 64] * 2:  # decodes only: one cost per unit of either kind
        pooled.observe(0, rows, 0, 0.050 + 0.004 * rows)
    assert pooled.fit() == pytest.approx((0.050, 0.004, 0.004, 0.0))
    flat = StepCost()
    for _ in range(MIN_SAMPLES):  # one size: all the time on the units
        flat.observe(10, 0, 0, 0.1)
    assert flat.fit() == pytest.approx((0.0, 0.01, 0.01, 0.0))
    flat.observe(0, 0, 0, 5.0)  # an empty step teaches nothing
    assert flat.fit() == pytest.approx((0.0, 0.01, 0.01, 0.0))


def test_step_cost_follows_a_change_of_speed():
    cost = StepCost()
    for units in [8, 64] * 20:
        cost.observe(units, 1, 0, 0.001 * (units + 1))
    for units in [8, 64] * 40:
        cost.observe(units, 1, 0, 0.004 * (units + 1))  # e.g. a neighbour took the other core
    assert cost.fit()[1] == pytest.approx(0.004, rel=0.05)


def test_step_cost_learns_what_a_prompt_logprob_token_weighs():
    """Prompt-logprob tokens' extra time is a term of its own: a token costing 2 ms plus
    4 ms for its logprobs weighs 3 units; never learnt: the configured weight, kept."""
    learnt, fixed = StepCost(1.4, learn_weight=True), StepCost(1.4)
    assert learnt.logprob_weight == 1.4, "nothing seen: the configured weight"
    for i, (units, rows, context) in enumerate(STEPS * 2):
        logprobs = units // 2 if i % 3 else 0
        seconds = 0.050 + 0.002 * units + 0.006 * rows + 1e-5 * context + 0.004 * logprobs
        for cost in (learnt, fixed):
            cost.observe(units, rows, context, seconds, logprobs)
    assert learnt.fit() == pytest.approx((0.050, 0.002, 0.006, 1e-5))
    assert learnt.logprob_weight == pytest.approx(3.0)
    assert fixed.logprob_weight == 1.4, "without learn_weight (no time cap) the configured one"
    plain = StepCost(1.4, learn_weight=True)
    for units, rows, context in STEPS * 2:
        plain.observe(units, rows, context, 0.050 + 0.002 * units + 0.006 * rows)
    assert plain.logprob_weight == 1.4, "no prompt-logprob step: nothing to learn it from"


def test_a_capped_step_sizes_prompt_logprob_chunks_by_the_learnt_weight():
    d = timed(driver(max_model_len=2048, max_step_ms=150.0, prompt_logprob_token_weight=1.4))
    for n in (8, 40):  # NOTE: 2 ms a token + 4 ms for its logprobs: 3 units
        d.sched.step_cost.observe(n, 0, 0, (50 + 6 * n) / 1000, n)
    plp = make_request("plp", 400, max_tokens=1, prompt_logprobs=1)
    d.add(plp)
    d.step()
    assert d.outs[0].num_batched_tokens == 16, "50 units of a 150 ms step: 16 tokens (1.4: 35)"
    check_outputs(d, plp)


def test_step_cost_prices_a_prefill_tokens_read_of_earlier_kv():
    """A chunk's tokens each read the KV before it (the context term counts attention pairs):
    at 10 us a pair and 2 ms a unit, a token from position 992 weighs 4.96 units more. 16
    siblings' 8-token tails over a 992-token prefix fit the same term as decodes do."""
    cost = StepCost()
    assert cost.read_weight(992) == 0.0, "nothing seen"
    for units, rows, context in STEPS * 2:
        cost.observe(units, rows, context, 0.050 + 0.002 * units + 0.006 * rows + 1e-5 * context)
    for tails in (4, 15, 8):
        pairs = tails * (8 * 992 + 36)
        cost.observe(8 * tails, 0, pairs, 0.050 + 0.002 * 8 * tails + 1e-5 * pairs)
    assert cost.fit() == pytest.approx((0.050, 0.002, 0.006, 1e-5))
    assert cost.read_weight(992) == pytest.approx(4.96)
    assert cost.read_weight(0) == 0.0


def test_step_cost_keeps_the_context_term_the_steps_need():
    """Where the full fit fails (here its prompt-logprob cost comes out below zero: those
    steps, the long-context ones, ran 0.1 ms fast), the fit that explains the steps best
    serves: the one with the context term, not the first simpler one (which would put the
    context's time on the logprobs); and a later fit without one keeps its price."""
    cost = StepCost(learn_weight=True)
    for units, rows, context in STEPS * 2:
        logprobs, early = (units // 2, 1e-4) if context >= 1500 and units else (0, 0.0)
        seconds = 0.050 + 0.002 * units + 0.006 * rows + 1e-5 * context - early
        cost.observe(units, rows, context, seconds, logprobs)
    assert cost.fit()[3] == pytest.approx(1e-5, rel=0.05)
    assert cost.read_weight(1000) == pytest.approx(5.0, rel=0.1)
    for _ in range(200):  # NOTE: context unseen since: the fits that remain cannot price it
        cost.observe(64, 4, 0, 0.050 + 0.002 * 64 + 0.006 * 4)
        cost.observe(16, 8, 0, 0.050 + 0.002 * 16 + 0.006 * 8)
    assert cost.fit()[3] == 0.0  # NOTE: the price a pair kept; in the new fit's units
    assert cost.read_weight(1000) * cost.fit()[1] == pytest.approx(1e-5 * 1000, rel=0.05)


def test_a_cached_prefix_counts_its_read_against_the_step():
    """Calls whose prompts are a cached prefix (62 blocks: 992 tokens) and 8 tokens of their
    own: each token reads the prefix (992 pairs x 1 us / 2 ms: 0.5 units more), so an
    admission costs 12 units, and a 150 ms step of 50 units admits four of them whole."""
    d = timed(driver(max_model_len=2048, max_step_ms=150.0), per_read_us=1.0)
    first = call("a", 1, 1000, max_tokens=1)[0]
    d.add(first)
    check_outputs(d, first)
    prefix = list(first.prompt_token_ids[: 16 * len(d.kv.find_cached_prefix(first.all_token_ids))])
    assert len(prefix) == 992
    tails = [call(f"t{i}", 1, prefix + [1 + i] * 8, max_tokens=1)[0] for i in range(6)]
    d.add(*tails)
    d.step()
    step = d.outs[-1]  # NOTE: the fifth gets the 1.5 units left: one token
    assert [(s.start_pos, s.num_tokens) for s in step.scheduled] == [(992, 8)] * 4 + [(992, 1)]
    assert step.budget_units == pytest.approx(4 * 8 * 1.496 + 1.496) and step.budget_units <= 50
    check_outputs(d, *tails)


def timed(d, fixed_ms: float = 50.0, per_unit_ms: float = 2.0, per_read_us: float = 0.0):
    """Teach ``d``'s scheduler a step cost of ``fixed_ms`` + ``per_unit_ms`` a unit (and a
    decode row), + ``per_read_us`` an attention pair if given."""
    cost = d.sched.step_cost
    for units in (1, 16, 64, 256):
        cost.observe(units, 0, 0, (fixed_ms + per_unit_ms * units) / 1000)
    for rows, pairs in ((1, 50_000), (8, 1000), (32, 20_000)) if per_read_us else ():
        cost.observe(
            0, rows, pairs, (fixed_ms + per_unit_ms * rows + per_read_us * pairs / 1e3) / 1000
        )
    return d


def test_max_step_ms_sizes_the_step_from_the_fitted_cost():
    d = timed(driver(max_model_len=2048, max_step_ms=150.0))  # (150 - 50) / 2 = 50 units
    long = make_request("long", 1000, max_tokens=2)
    d.add(long)
    d.step()
    assert d.outs[0].num_batched_tokens == 50
    assert d.outs[0].budget_units == 50
    check_outputs(d, long)
    assert max(o.num_batched_tokens for o in d.outs) == 50


@pytest.fixture
def _alone(monkeypatch):
    """Shared steps off: the rules a client alone meets (the last tests turn them on)."""
    monkeypatch.setattr(scheduler_mod.SharedSteps, "note", lambda self, clients: False)


@pytest.mark.usefixtures("_alone")
def test_max_step_ms_never_starves_decodes_prefills_or_newcomers():
    d = timed(driver(max_step_ms=1.0))  # nothing fits 1 ms
    decoders = streams("a", 8, max_tokens=20)
    d.add(*decoders)
    for _ in range(3):
        d.step()
    assert all(r.num_output_tokens for r in decoders)
    long = call("long", 1, 500, max_tokens=1)[0]
    d.add(long)
    d.step()  # the decodes and, for the long prompt, prefill worth their cost: (50 + 16) / 2
    assert d.outs[-1].num_batched_tokens == 8 + 33
    short = call("short", 1, 40, max_tokens=1)[0]
    d.add(short)
    d.step()  # the long prompt's floor, and as much again for the newcomer
    assert {s.req_id: s.num_tokens for s in d.outs[-1].scheduled if s.num_tokens > 1} == {
        "long0": MIN_PREFILL_UNITS,
        "short0": MIN_PREFILL_UNITS,
    }
    check_outputs(d, *decoders, long, short)


def test_running_prefills_leave_the_reserve_to_a_newcomer(monkeypatch):
    """A long prompt takes every time-capped step (50 units alone); a small call arriving
    gets the reserve, the long prompt what the step leaves beside it: shared, the step is two
    one-row steps (104 ms: 27 units) raised to the reserve (32), and running prefills have no
    floor of their own above it (express steps off: the next tests)."""
    monkeypatch.setattr(scheduler_mod, "EXPRESS_GAIN", float("inf"))
    d = timed(driver(max_model_len=2048, max_step_ms=150.0))
    long = call("long", 1, 1500, max_tokens=1)[0]
    d.add(long)
    d.step()
    small = call("small", 1, 20, max_tokens=1)[0]
    small.client = "b"
    assert steps_to_first_token(d, small) == 1
    scheduled = {s.req_id: s.num_tokens for s in d.outs[-1].scheduled}
    assert d.outs[-2].num_batched_tokens == 50
    assert scheduled == {"long0": 1, "small0": 20}
    assert d.outs[-1].budget_units == 21 and MIN_PREFILL_UNITS == 32
    check_outputs(d, long, small)


def _beside_decodes(max_step_ms: float | None, streams_count: int = 62):
    """``streams_count`` decoding streams of client a; steps cost 10 ms + 2 ms a row or unit."""
    d = timed(driver(max_num_seqs=64, max_step_ms=max_step_ms), fixed_ms=10.0)
    flood = streams("a", streams_count, max_tokens=40)
    d.add(*flood)
    for _ in range(20):
        d.step()
        if all(r.num_output_tokens for r in flood):
            return d, flood
    raise AssertionError("the streams never all decoded")


def _probe(client: str, length: int = 8) -> Request:
    req = call(f"probe-{client}", 1, length, max_tokens=2)[0]
    req.client = client
    return req


@pytest.mark.usefixtures("_alone")
def test_a_new_clients_small_prompt_runs_alone_beside_a_long_step():
    """Beside 62 decodes (a 134-ms step) a new client's 8-token prompt runs in a step of its
    own (26 ms); a second new client arriving next shares the following step: never two
    express steps in a row, so the decodes lose at most every other step."""
    d, flood = _beside_decodes(max_step_ms=150.0)
    first, second = _probe("b"), _probe("c")
    assert steps_to_first_token(d, first) == 1
    assert [s.req_id for s in d.outs[-1].scheduled] == [first.request_id]
    assert d.outs[-1].budget_units == 8 and d.sched.num_express == 1
    assert steps_to_first_token(d, second) == 1
    shared = {s.req_id for s in d.outs[-1].scheduled}
    assert second.request_id in shared and len(shared) == 64, "decodes, the first's 2nd token"
    assert d.sched.num_express == 1
    check_outputs(d, *flood, first, second)


@pytest.mark.usefixtures("_alone")
@pytest.mark.parametrize("case", ["uncapped", "short step", "prompt too long", "own client"])
def test_no_express_step_where_it_does_not_pay(case):
    """Offline (no time cap), beside a short step (4 decodes: 34 ms with the newcomer, 26 ms
    alone), for a prompt the express step cannot finish, or for a client that already has a
    call live: the newcomer shares the step with the running requests."""
    d, flood = _beside_decodes(
        max_step_ms=None if case == "uncapped" else 150.0,
        streams_count=4 if case == "short step" else 62,
    )
    probe = _probe("a" if case == "own client" else "b", 200 if "long" in case else 8)
    d.add(probe)
    d.step()
    assert len(d.outs[-1].scheduled) > 1 and d.sched.num_express == 0
    check_outputs(d, *flood, probe)


@pytest.mark.usefixtures("_alone")
def test_an_express_step_takes_new_clients_while_it_stays_short():
    """Ten new clients' 8-token prompts beside 56 decodes: the k-th joins while the step it
    would share (138 ms) lasts 1.5 times the express step with it (10 + 16k ms): five."""
    d, flood = _beside_decodes(max_step_ms=150.0, streams_count=56)
    probes = [_probe(c) for c in "bcdefghijk"]
    d.add(*probes)
    d.step()
    assert [s.req_id for s in d.outs[-1].scheduled] == [p.request_id for p in probes[:5]]
    assert d.outs[-1].budget_units == 40 <= EXPRESS_UNITS
    check_outputs(d, *flood, *probes)


def test_shared_steps_cut_the_decodes_and_serve_them_in_turn():
    """62 decodes of client a alone fill every step; once client b has come, a step holds
    what fits two one-row steps (10 ms + 2 ms a row: 24 ms), at least 25 ms (7 decodes),
    those served longest ago first, so each decode is served in any nine steps running;
    RECENT_STEPS steps and RECENT_S seconds after b has gone, the steps are whole again."""
    d, flood = _beside_decodes(max_step_ms=150.0)
    now = [0.0]
    d.sched.shared.clock = lambda: now[0]
    d.step()
    assert sum(s.num_tokens == 1 for s in d.outs[-1].scheduled) == 62
    probe = _probe("b")
    d.add(probe)
    served: list[set[str]] = []
    while probe.status is not RequestStatus.FINISHED:
        d.step()
    for _ in range(9):
        d.step()
        served.append({s.req_id for s in d.outs[-1].scheduled})
    assert [len(ids) for ids in served] == [7] * 9
    assert set().union(*served) == {r.request_id for r in flood}, "each in nine steps"
    assert d.sched.shared.steps >= 9
    for _ in range(RECENT_STEPS):
        d.step()
    assert len(d.outs[-1].scheduled) < 62, "b was here within RECENT_S"
    now[0] += RECENT_S
    d.step()
    assert len(d.outs[-1].scheduled) == 62, "b gone: whole steps again"
    check_outputs(d, *flood, probe)


def test_shared_a_clients_own_queued_calls_get_the_small_floor(monkeypatch):
    """Shared (client b came and went within RECENT_S), client a's own queued call takes
    MIN_UNITS of prefill beside a's decodes, so the steps a newcomer waits for stay short; a
    newcomer's prompt still gets MIN_PREFILL_UNITS, whole in one chunk (express steps off)."""
    monkeypatch.setattr(scheduler_mod, "EXPRESS_GAIN", float("inf"))
    d, flood = _beside_decodes(max_step_ms=150.0, streams_count=8)
    d.sched.shared.clock = lambda: 0.0
    probe = _probe("b")
    d.add(probe)
    while probe.status is not RequestStatus.FINISHED:
        d.step()
    more = call("a-more", 1, 100, max_tokens=1)[0]
    more.client = "a"
    d.add(more)
    d.step()
    prefill = {s.req_id: s.num_tokens for s in d.outs[-1].scheduled if s.num_tokens > 1}
    assert prefill == {more.request_id: MIN_UNITS} and MIN_UNITS < MIN_PREFILL_UNITS
    newcomer = _probe("c", 30)
    d.add(newcomer)
    d.step()
    prefill = {s.req_id: s.num_tokens for s in d.outs[-1].scheduled if s.num_tokens > 1}
    assert prefill[newcomer.request_id] == 30
    check_outputs(d, *flood, probe, more, newcomer)


def test_a_client_back_within_seconds_still_counts_as_present():
    """A client is present for RECENT_STEPS steps or RECENT_S seconds after its last live
    request, whichever lasts longer: 32 short steps are 0.7 s on two CPU cores, and a client
    back every second or two must not find the heavy client's long steps each time."""
    now = [0.0]
    shared = SharedSteps(clock=lambda: now[0])
    assert not shared.note({"a"})
    assert shared.note({"a", "b"})
    for _ in range(3 * RECENT_STEPS):  # NOTE: 20-ms steps: 1.9 s
        now[0] += 0.02
        assert shared.note({"a"})
    now[0] = RECENT_S + 0.01
    assert not shared.note({"a"}), "b gone for RECENT_S and RECENT_STEPS"
    assert shared.note({"a", "c"})
    for _ in range(RECENT_STEPS - 1):  # NOTE: 1-s steps: RECENT_STEPS count
        now[0] += 1.0
        assert shared.note({"a"})
    now[0] += 1.0
    assert not shared.note({"a"})


def test_many_alike_clients_keep_whole_steps():
    """Eight clients of four streams each, all present: none holds half the batch, so no
    step is cut (cut, 32 clients' streams ran 23% slower); one client's flood of 32 more
    makes it the heavy one, and the steps are shared again."""
    d = timed(driver(max_num_seqs=64, max_step_ms=150.0), fixed_ms=10.0)
    flood = [r for c in "abcdefgh" for r in streams(c, 4, max_tokens=20)]
    d.add(*flood)
    while not all(r.num_output_tokens for r in flood):
        d.step()
    before = d.sched.shared.steps  # NOTE: a's first seats, alone running, were shared
    d.step()
    assert len(d.outs[-1].scheduled) == 32 and d.sched.shared.steps == before
    heavy = streams("a", 32, max_tokens=12)
    for r in heavy:
        r.request_id = "more-" + r.request_id
    d.add(*heavy)
    while not all(r.num_output_tokens for r in heavy):
        d.step()
    before = d.sched.shared.steps
    d.step()
    assert d.sched.shared.steps == before + 1 and len(d.outs[-1].scheduled) < 64
    check_outputs(d, *flood, *heavy)


def test_a_gpus_shared_step_cuts_no_decode():
    """A GPU's step: 5 ms fixed, 20 us a decode row, 1 ns a token read: a shared step is
    25 ms (the floor, not two 5-ms steps) and holds 256 decodes of 2k-token contexts."""
    fit = (0.005, 1e-5, 2e-5, 1e-9)
    assert shared_seconds(fit) == SHARED_MIN_S
    assert decodes_within(fit, shared_seconds(fit), 256, 256 * 2048) == 256
    assert decodes_within((0.010, 0.002, 0.002, 0.0), 0.050, 62, 62 * 100) == 20


def test_shared_steps_cap_a_prefill_beside_another_clients_decode():
    """A 1000-token prompt of client a beside client b's stream: the chunks fit two one-row
    steps (50 ms + 2 ms a unit: 104 ms, under the 250 ms cap: 26 units beside the decode),
    without the stretch to twice the step's unavoidable cost; its first chunk, admitted from
    the queue, has the newcomer's reserve (32)."""
    d = timed(driver(max_model_len=2048, max_step_ms=250.0))
    stream = call("b", 1, 4, max_tokens=30)[0]
    stream.client = "b"
    long = call("a", 1, 1000, max_tokens=1)[0]
    d.add(stream)
    d.step()
    d.add(long)
    d.step()
    assert {s.req_id: s.num_tokens for s in d.outs[-1].scheduled} == {"b0": 1, "a0": 32}
    d.step()
    assert {s.req_id: s.num_tokens for s in d.outs[-1].scheduled} == {"b0": 1, "a0": 26}
    check_outputs(d, stream, long)


def test_no_shared_steps_for_a_client_alone_or_offline():
    """Client a's own second call, and sequences of no call (the offline API's), share no
    step with another client: the steps stay whole."""
    d, flood = _beside_decodes(max_step_ms=150.0)
    more = call("a-more", 1, 8, max_tokens=5)
    more[0].client = "a"
    offline = streams("x", 4, max_tokens=5)
    for r in offline:
        r.group = None
    d.add(*more, *offline)
    check_outputs(d, *flood, *more, *offline)
    assert d.sched.shared.steps == 0


# -- engine ------------------------------------------------------------------------------------
def _noted(schedule, sizes: list[int]):
    out = schedule()
    sizes.append(out.num_batched_tokens)
    return out


def _noted_call(fn, calls: list[tuple], *args):
    calls.append(args)
    return fn(*args)


def test_the_sync_loop_prices_a_step_by_its_wall_time(path):
    """In the sync loop the host's part of a step (planning, output processing, both growing
    with the rows) holds the next step as the device's does: the fit gets the step's wall
    time, here over 20 ms of planning the device never sees."""
    import time

    engine = make_engine(path, False, max_step_ms=1000.0)
    plan = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (time.sleep(0.02), plan())[1]
    seen: list[tuple] = []
    engine.scheduler.step_cost.observe = partial(
        _noted_call, engine.scheduler.step_cost.observe, seen
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("r", random_prompts([20], VOCAB_SIZE, seed=1)[0], params)
    drain(engine, {})
    assert len(seen) >= 4 and min(a[3] for a in seen) >= 0.02, seen


@pytest.mark.parametrize("pipelined", [False, True])
def test_engine_learns_the_step_cost_and_caps_steps_by_time(path, pipelined):
    """The loop feeds each retired step's time, rows and context to the fit; with a
    cap no step could meet (its chunks set by the fit, as the scheduler tests show), the
    tokens and prompt logprobs are those of the uncapped engine."""
    prompts = random_prompts([110, 100, 90, 80], VOCAB_SIZE, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2)
    results = []
    for step_ms in (None, 1e-3):
        engine = make_engine(path, pipelined, max_step_ms=step_ms)
        sizes: list[int] = []
        engine.scheduler.schedule = partial(_noted, engine.scheduler.schedule, sizes)
        cost, seen = engine.scheduler.step_cost, []
        cost.observe = partial(_noted_call, cost.observe, seen)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params, group=f"r{i}")
        outs: dict = {}
        drain(engine, outs)
        results.append(outs)
        known = MIN_SAMPLES + 2  # NOTE: pipelined: two steps are planned before one retires
        assert sum(a[4] for a in seen) == sum(len(p) - 1 for p in prompts), "logprob tokens"
        assert cost.samples >= len(sizes) - 2 > known and cost.fit() is not None
        assert max(sizes[:MIN_SAMPLES]) >= 45  # 64 units: 45 prompt-logprob tokens at least
        fixed, per_unit, per_row, per_read = cost.fit()
        assert fixed >= 0 and min(per_unit, per_row) > 0 and per_read >= 0
    plain, capped = results
    for rid in plain:
        assert capped[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids
        for a, b in zip(capped[rid].prompt_logprobs, plain[rid].prompt_logprobs, strict=True):
            # NOTE: other chunk sizes sum in another order: fp32 rounding only
            assert (a is None and b is None) or (
                a.keys() == b.keys()
                and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
            )
