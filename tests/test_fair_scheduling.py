"""Fair scheduling (``core.scheduler``'s policy): round robin between calls, reserved seats,
capped prefill chunks, prompt-logprob tokens weighted in the budget, and the bound: a new
small call is scheduled in the first step after it arrives, beside a many-prompt call, a long
prefill or an echo + prompt_logprobs + n=16 request. Counted in steps, never in seconds.

Mostly on the scheduler with the fake runner of ``test_scheduler`` (whose tokens depend only
on the request and position: outputs are checked against ``reference_output``); the engine
tests run the tiny model.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import random_prompts
from tests.test_scheduler import Driver, make_request, reference_output, workloads
from tests.tiny_models import VOCAB_SIZE
from warmboot.config import CacheConfig, EngineConfig, SchedulerConfig
from warmboot.core import scheduler as scheduler_mod
from warmboot.core.request import Request
from warmboot.core.scheduler import Scheduler
from warmboot.engine.llm_engine import LLMEngine
from warmboot.sampling_params import SamplingParams


def driver(num_blocks: int = 1000, block_size: int = 16, **cfg) -> Driver:
    """A ``Driver`` on the default scheduler config, ``cfg`` overriding it."""
    d = Driver(num_blocks=num_blocks, block_size=block_size)
    d.sched = Scheduler(SchedulerConfig(**cfg), d.kv)
    return d


def call(name: str, prompts: int, length: int, grouped: bool = True, **kw) -> list[Request]:
    """One API call: a request per prompt, all in group ``name`` unless not ``grouped``."""
    reqs = [make_request(f"{name}{i}", length, **kw) for i in range(prompts)]
    for r in reqs:
        r.group = name if grouped else None
    return reqs


def with_siblings(group: str, prompt: int, n: int, **kw) -> list[Request]:
    """One prompt with ``n`` completions (a leader and its siblings), as ``LLMEngine`` adds."""
    leader = make_request(f"{group}#0", prompt, **kw)
    sibs = [
        make_request(f"{group}#{i}", list(leader.prompt_token_ids), leader=leader, **kw)
        for i in range(1, n)
    ]
    for i, r in enumerate([leader, *sibs]):
        r.group, r.completion_index = group, i
    return [leader, *sibs]


def steps_to_first_token(d: Driver, req: Request, limit: int = 1000) -> int:
    """Add ``req`` and step until it has its first token; how many steps that took."""
    d.add(req)
    for n in range(1, limit + 1):
        d.step()
        if req.output_token_ids:
            return n
    raise AssertionError(f"{req.request_id} got no token in {limit} steps")


def admission_order(d: Driver) -> list[str]:
    order: list[str] = []
    for o in d.outs:
        order += [s.req_id for s in o.scheduled if s.req_id not in order]
    return order


def check_outputs(d: Driver, *reqs: Request) -> None:
    d.run()
    for r in reqs:
        assert r.output_token_ids == reference_output(r), r.request_id
    assert d.kv.num_used_blocks == 0


# -- the default: FCFS as before ------------------------------------------------------------
def test_without_groups_admission_is_fcfs():
    d = driver(max_num_seqs=3, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 5 + i % 7, max_tokens=3 + i % 4) for i in range(24)]
    d.add(*reqs)
    check_outputs(d, *reqs)
    assert admission_order(d) == [r.request_id for r in reqs]
    assert all(r.turn == 0 and r.rank == 0 for r in reqs)
    assert d.sched.turns.round == 0


def test_config_defaults_and_checks():
    cfg = SchedulerConfig()
    assert (cfg.prefill_chunk, cfg.seat_ranks) == (512, (60, 62))
    assert SchedulerConfig(max_num_batched_tokens=8192).prefill_chunk == 2048
    assert SchedulerConfig(max_num_batched_tokens=100).prefill_chunk == 100
    assert SchedulerConfig(long_prefill_token_threshold=0).prefill_chunk == 2048
    assert SchedulerConfig(max_num_seqs=1).seat_ranks == (1, 1)  # never every seat reserved
    assert SchedulerConfig(max_num_seqs=8, reserved_seats=0).seat_ranks == (8, 8)
    assert SchedulerConfig(max_num_seqs=8, reserved_seats=1).seat_ranks == (7, 7)
    for bad in (
        dict(long_prefill_token_threshold=-1),
        dict(reserved_seats=-1),
        dict(prompt_logprob_token_weight=0.5),
        dict(max_step_ms=-1),
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


# -- round robin between calls ----------------------------------------------------------------
def test_calls_take_turns():
    d = driver(max_num_seqs=2, reserved_seats=0, max_num_batched_tokens=64)
    a = call("a", 6, 4, max_tokens=2)
    d.add(*a)
    d.step()
    b = call("b", 6, 4, max_tokens=2)
    d.add(*b)
    check_outputs(d, *a, *b)
    order = admission_order(d)
    assert order[:2] == ["a0", "a1"]
    # from b's arrival on: one sequence of each call per round, b first in its first round
    assert order[2:] == ["b0", "a2", "b1", "a3", "b2", "a4", "b3", "a5", "b4", "b5"]


def test_a_stream_of_small_calls_does_not_starve_a_big_one():
    d = driver(max_num_seqs=2, reserved_seats=0, max_num_batched_tokens=64)
    big = call("big", 5, 4, max_tokens=2)
    d.add(*big)
    small = []
    for i in range(40):
        small += call(f"s{i}-", 1, 3, max_tokens=1)
        d.add(small[-1])
        d.step()
    check_outputs(d, *big, *small)
    admitted = admission_order(d)
    # every round admits one of the big call's prompts: it finishes while small calls arrive
    assert admitted.index("big4") < admitted.index("s20-0")


def test_completions_of_a_call_take_turns_too():
    d = driver(max_num_seqs=4, reserved_seats=0, max_num_batched_tokens=256)
    big = with_siblings("big", 20, 8, max_tokens=6)
    d.add(*big)
    d.step()  # the leader's prompt
    d.step()  # four completions run
    new = call("new", 1, 5, max_tokens=1)[0]
    d.add(new)
    # the next free seat goes to the new call, not to the 5th completion
    while not new.output_token_ids:
        d.step()
    order = admission_order(d)
    assert order.index("new0") == 4
    check_outputs(d, *big, new)


def test_priority_comes_before_turns():
    d = driver(max_num_seqs=1, max_num_batched_tokens=64)
    urgent = call("u", 3, 4, max_tokens=1, priority=-1)
    late = call("l", 1, 4, max_tokens=1)
    d.add(*late, *urgent)
    check_outputs(d, *urgent, *late)
    assert admission_order(d) == ["u0", "u1", "u2", "l0"]


# -- the bound ------------------------------------------------------------------------------
@pytest.mark.parametrize("grouped", [True, False])
def test_small_call_beside_a_many_prompt_call(grouped):
    """200 prompts arrive together (a 1000-prompt call, smaller), generating long enough that
    no seat frees for 40 steps; a 1-prompt call arriving then starts in the next step."""
    d = driver()
    big = call("big", 200, 24, grouped, max_tokens=40)
    d.add(*big)
    for _ in range(3):
        d.step()
    small = call("small", 1, 8, grouped, max_tokens=1)[0]
    steps = steps_to_first_token(d, small)
    if grouped:
        assert steps == 1
        assert len(d.sched.running) == d.sched.config.seat_ranks[0]  # big waits for seats
    else:
        assert steps > 40  # FCFS: behind every waiting prompt of the big call
    check_outputs(d, *big, small)


def test_small_call_beside_a_long_prefill():
    d = driver(max_model_len=2048)
    long = call("long", 1, 2000, max_tokens=2)[0]
    d.add(long)
    d.step()
    small = call("small", 1, 10, max_tokens=1)[0]
    assert steps_to_first_token(d, small) == 1
    check_outputs(d, long, small)
    chunks = [s.num_tokens for _, s in d.rows(long.request_id) if s.start_pos < 2000]
    assert chunks == [512, 512, 512, 464]


def test_a_long_prefill_alone_takes_the_whole_budget_without_a_cap():
    d = driver(long_prefill_token_threshold=0)
    long = make_request("long", 2000, max_tokens=1)
    d.add(long)
    d.step()
    assert [s.num_tokens for s in d.outs[0].scheduled] == [2000]
    check_outputs(d, long)


def test_small_call_beside_echo_prompt_logprobs_n16():
    d = driver(max_model_len=2048)
    big = with_siblings("big", 1000, 16, max_tokens=16, prompt_logprobs=20)
    d.add(*big)
    d.step()
    small = call("small", 1, 10, max_tokens=1)[0]
    assert steps_to_first_token(d, small) == 1
    check_outputs(d, *big, small)
    weight = d.sched.config.prompt_logprob_token_weight
    chunks = [s for _, s in d.rows("big#0") if s.start_pos < 1000]
    cap = int(512 / weight)
    assert [s.num_tokens for s in chunks] == [cap, cap, 1000 - 2 * cap]
    # the prompt's logprobs are asked for once, by the leader: one target per token
    targets = [t for o in d.outs for s in o.scheduled for t in s.prompt_logprob_targets]
    assert targets == list(big[0].prompt_token_ids[1:])
    for o in d.outs:
        rows = [s for s in o.scheduled if s.prompt_logprob_targets]
        assert all(s.req_id == "big#0" for s in rows)
        cost = sum(s.num_tokens * (weight if s.prompt_logprob_targets else 1) for s in o.scheduled)
        assert cost <= d.sched.config.max_num_batched_tokens
    # the siblings share the leader's prompt: each computes only the last partial block
    for sib in big[1:]:
        assert sib.num_cached_tokens == 992


def test_a_small_prompt_admitted_behind_a_long_prefill_finishes_in_its_next_step():
    """Admitted with the 2 units a long prefill left (weight 3: 66 tokens cost 198 of 200),
    the small prompt's other 8 tokens are claimed before the long prefill's next chunk (they
    got 2 tokens a step before: 5 steps to the first token)."""
    d = driver(max_num_batched_tokens=200, prompt_logprob_token_weight=3.0)
    big = make_request("big", 1000, max_tokens=1, prompt_logprobs=0)
    d.add(big)
    d.step()
    small = call("small", 1, 10, max_tokens=4)[0]
    assert steps_to_first_token(d, small) == 2
    assert [s.num_tokens for _, s in d.rows("small0")] == [2, 8]
    for _ in range(3):  # decoding behind the long prefill: a token every step
        d.step()
        assert d.rows("small0")[-1][0] == len(d.outs) - 1
    check_outputs(d, big, small)


def test_prompt_logprob_tokens_count_against_the_budget():
    d = driver(max_num_batched_tokens=300, prompt_logprob_token_weight=1.5)
    plp = make_request("plp", 400, max_tokens=1, prompt_logprobs=1)
    d.add(plp)
    d.step()
    assert d.outs[0].scheduled[0].num_tokens == 200  # 300 / 1.5
    check_outputs(d, plp)


def test_budget_left_under_one_weighted_token_still_serves_a_token():
    d = driver(max_num_batched_tokens=7, prompt_logprob_token_weight=10.0)
    plp = make_request("plp", 5, max_tokens=2, prompt_logprobs=0)
    d.add(plp)
    check_outputs(d, plp)
    assert [o.num_batched_tokens for o in d.outs[:5]] == [1] * 5


def test_reserved_seats_go_to_first_sequences_only():
    """Of 2 reserved seats, a call's later sequences take neither, a new call of a busy client
    the first, a new client the last."""
    d = driver(max_num_seqs=8, reserved_seats=2)
    big = call("big", 20, 4, max_tokens=50)
    d.add(*big)
    d.step()
    assert len(d.sched.running) == 6
    news = [call(f"n{i}-", 1, 4, max_tokens=50)[0] for i in range(3)]
    d.add(*news[:2])
    d.step()
    assert "n0-0" in {r.request_id for r in d.sched.running}
    assert [r.request_id for r in d.sched.waiting][:1] == ["n1-0"]  # the last seat: clients'
    news[2].client = "other"
    d.add(news[2])
    d.step()
    assert "n2-0" in {r.request_id for r in d.sched.running}
    check_outputs(d, *big, *news)


def test_a_clients_second_call_takes_the_reserve_once_its_first_ends():
    """A client's two overlapping calls beside another client's flood of calls (each stream a
    call, as 256 streams are): the second arrives as a later sequence of its client, and when
    the first ends it becomes the client's first, taking the last seat at once instead of
    waiting for the flood's 50-token streams (the fairness bench's streams load: p99 9.9 s)."""
    d = driver(max_num_seqs=8, reserved_seats=2)
    flood = [call(f"f{i}-", 1, 4, max_tokens=50)[0] for i in range(20)]
    for r in flood:
        r.client = "flood"
    d.add(*flood)
    d.step()
    assert len(d.sched.running) == 7
    first, second = call("a", 1, 4, max_tokens=3)[0], call("b", 1, 4, max_tokens=2)[0]
    first.client = second.client = "probe"
    d.add(first)
    d.step()
    assert steps_to_first_token(d, second) <= 4
    check_outputs(d, *flood, first, second)


def test_a_reserve_blocked_sequence_is_not_overtaken_by_lower_priority():
    d = driver(max_num_seqs=2, reserved_seats=1)
    big = call("big", 3, 4, max_tokens=20)
    low = call("low", 1, 4, max_tokens=1, priority=1)[0]
    d.add(*big, low)
    d.step()
    assert [r.request_id for r in d.sched.running] == ["big0"]
    assert [r.request_id for r in d.sched.waiting] == ["big1", "big2", "low0"]
    check_outputs(d, *big, low)


@pytest.mark.parametrize("pipelined", [False, True])
def test_preempted_sequences_keep_their_turn(pipelined):
    d = driver(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    calls = [call(f"c{i}-", 4, 9 + i, max_tokens=12) for i in range(4)]
    for c in calls:
        d.add(*c)
    if pipelined:
        d.run_pipelined()
    else:
        d.run()
    assert d.sched.num_preemptions > 0
    for c in calls:
        for r in c:
            assert r.output_token_ids == reference_output(r)
    assert d.kv.num_used_blocks == 0
    assert not d.sched.turns._clients  # every client and call forgotten once done


# -- property test: random workloads with calls ------------------------------------------------
@st.composite
def fair_workloads(draw):
    w = draw(workloads())
    for spec in w["reqs"]:
        lead = spec["leader"]
        spec["group"] = draw(st.sampled_from(["a", "b", "c", None]))
        spec["group"] = w["reqs"][lead]["group"] if lead is not None else spec["group"]
        spec["plp"] = draw(st.sampled_from([None, None, 0, 3]))
        spec["plp"] = w["reqs"][lead]["plp"] if lead is not None else spec["plp"]
        spec["client"] = draw(st.sampled_from(["", "x", "y"]))
        spec["client"] = w["reqs"][lead]["client"] if lead is not None else spec["client"]
    w["cap"] = draw(st.sampled_from([None, 0, 1, 3, 8]))
    w["reserve"] = draw(st.sampled_from([None, 0, 1, 3]))
    w["weight"] = draw(st.sampled_from([1.0, 1.4, 3.0]))
    w["pipelined"] = draw(st.booleans())
    w["step_ms"] = draw(st.sampled_from([None, 5.0, 40.0, 400.0]))
    w["min_units"] = draw(st.sampled_from([32, 1, 2, 4]))  # small: budgets here claim too
    return w


def make_calls(w) -> list[Request]:
    made: list[Request] = []
    for spec in w["reqs"]:
        leader = made[spec["leader"]] if spec["leader"] is not None else None
        r = make_request(
            spec["id"],
            spec["prompt"],
            spec["max_tokens"],
            leader=leader,
            prompt_logprobs=spec["plp"],
        )
        r.group, r.client = spec["group"], spec["client"]
        r.completion_index = sum(m.leader is leader for m in made) if leader else 0
        made.append(r)
    return made


def run_workload(w, d: Driver, made: list[Request]) -> None:
    arrivals = defaultdict(list)
    for spec, r in zip(w["reqs"], made, strict=True):
        arrivals[spec["arrival"]].append(r)
    total = sum(len(r.prompt_token_ids) + r.max_tokens for r in made)
    step, in_flight = 0, deque()
    while step <= 8 or d.sched.has_unfinished() or in_flight:
        assert step <= 2 * (8 + total) + 5, "no progress (livelock)"
        d.add(*arrivals.get(step, []))
        if d.sched.has_unfinished() and w["pipelined"]:
            in_flight.append(d.launch())
        elif d.sched.has_unfinished():
            assert not d.step().is_empty, "empty step while requests wait"
        while in_flight and (len(in_flight) > 1 or not d.sched.has_unfinished()):
            d.commit(in_flight.popleft())
        step += 1


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(w=fair_workloads())
def test_random_workloads_with_calls(w):
    """Clients, calls, chunk caps, reserves, weights and time caps never change a token, lose a
    block or stall;
    a step's weighted cost stays within the budget; prompt logprobs are asked for once."""
    cfg = SchedulerConfig(
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["budget"],
        long_prefill_token_threshold=w["cap"],
        reserved_seats=w["reserve"],
        prompt_logprob_token_weight=w["weight"],
        max_step_ms=w["step_ms"],
    )
    d = Driver(num_blocks=w["num_blocks"], block_size=w["bs"], caching=w["caching"])
    d.sched = Scheduler(cfg, d.kv)
    for units in (1, 8, 16, 32):  # a step costs 10 ms + 1 ms a unit
        d.sched.step_cost.observe(units, 0, 0, 0.010 + 0.001 * units)
    made = make_calls(w)
    with patch.object(scheduler_mod, "MIN_PREFILL_UNITS", w["min_units"]):
        run_workload(w, d, made)
    assert not d.sched.requests and not d.sched.turns._clients
    assert d.kv.num_used_blocks == 0 and d.kv.num_held_blocks == 0
    for r in made:
        assert r.output_token_ids == reference_output(r)
        targets = [
            t
            for o in d.outs
            for s in o.scheduled
            if s.req_id == r.request_id
            for t in s.prompt_logprob_targets
        ]
        wanted = r.params.prompt_logprobs is not None and r.completion_index == 0
        assert targets == (list(r.prompt_token_ids[1:]) if wanted else [])
    for o in d.outs:
        for s in o.scheduled:
            assert s.num_tokens <= cfg.prefill_chunk
        weights = [w["weight"] if s.prompt_logprob_targets else 1 for s in o.scheduled]
        cost = sum(n.num_tokens * k for n, k in zip(o.scheduled, weights, strict=True))
        assert (
            cost <= cfg.max_num_batched_tokens
            or len(o.scheduled) == 1
            or any(s.num_tokens == 1 and k > 1 for s, k in zip(o.scheduled, weights, strict=True))
        )


# -- engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(path, pipelined: bool, **sched) -> LLMEngine:
    sched = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128) | sched
    config = EngineConfig(
        model=str(path),
        device="cpu",
        pipelined=pipelined,
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(**sched),
    )
    return LLMEngine(config)


def drain(engine: LLMEngine, outs: dict, until: str | None = None) -> int:
    """Step until idle (or ``until`` finished); the number of steps."""
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        for o in engine.step():
            outs[o.request_id] = o
        if until in outs and outs[until].finished:
            break
    return n


def add_workload(engine: LLMEngine, grouped: bool) -> None:
    prompts = random_prompts([100, 30, 7, 12, 20, 9], VOCAB_SIZE, seed=3)
    g = (lambda name: name) if grouped else (lambda name: None)
    plp = SamplingParams(temperature=0.0, max_tokens=6, n=4, prompt_logprobs=3)
    engine.add_request("plp", prompts[0], plp, group=g("plp"))
    for i, p in enumerate(prompts[1:]):
        params = SamplingParams(temperature=0.0, max_tokens=8)
        engine.add_request(f"many{i}", p, params, group=g("many"))


@pytest.mark.parametrize("pipelined", [False, True])
def test_engine_outputs_unchanged_and_small_call_bounded(path, pipelined):
    """Greedy tokens and prompt logprobs are the policy's to keep: grouped calls with capped,
    weighted chunks give what FCFS with whole-budget chunks gives; and a call arriving beside
    them gets its token in the first step scheduled after its arrival."""
    fair = make_engine(path, pipelined, long_prefill_token_threshold=16)
    fcfs = make_engine(path, pipelined, long_prefill_token_threshold=0, reserved_seats=0)
    results = []
    for engine, grouped in ((fair, True), (fcfs, False)):
        outs: dict = {}
        add_workload(engine, grouped)
        drain(engine, outs, until="many0")
        small = SamplingParams(temperature=0.0, max_tokens=1)
        engine.add_request("small", [5, 6, 7], small, group="small" if grouped else None)
        steps = drain(engine, outs, until="small")
        drain(engine, outs)
        results.append((steps, outs))
    (fair_steps, fair_outs), (_, fcfs_outs) = results
    assert fair_steps == (3 if pipelined else 1)  # pipelined: two steps already in flight
    assert fair_outs.keys() == fcfs_outs.keys()
    for rid, out in fair_outs.items():
        ref = fcfs_outs[rid]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs], rid
    lps, ref_lps = fair_outs["plp"].prompt_logprobs, fcfs_outs["plp"].prompt_logprobs
    assert len(lps) == len(ref_lps) == 100
    for a, b in zip(lps[1:], ref_lps[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    for engine in (fair, fcfs):
        engine.startup.close()


def test_engine_computes_prompt_logprobs_once_for_n_completions(path):
    engine = make_engine(path, False, long_prefill_token_threshold=16)
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.extend((s.req_id, s.num_tokens, len(s.prompt_logprob_targets)) for s in out.scheduled)
        return out

    engine.scheduler.schedule = spy
    (prompt,) = random_prompts([90], VOCAB_SIZE, seed=5)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=3, n=16, prompt_logprobs=2)
    engine.add_request("x", prompt, params, group="call-1")
    outs: dict = {}
    drain(engine, outs)
    with_targets = [(rid, n, t) for rid, n, t in seen if t]
    assert {rid.split("@")[0] for rid, _, _ in with_targets} == {"x#0"}
    assert sum(t for _, _, t in with_targets) == 89
    weight = engine.sched_config.prompt_logprob_token_weight
    assert max(n for _, n, _ in with_targets) == int(16 / weight)
    assert len(outs["x"].outputs) == 16 and len(outs["x"].prompt_logprobs) == 90
    engine.startup.close()


def test_engine_ranks_the_sequences_of_a_group(path):
    engine = make_engine(path, False)
    params = SamplingParams(temperature=0.0, max_tokens=1, n=2)
    for i in range(2):
        engine.add_request(f"p{i}", [1, 2, 3], params, group="call")
    engine.add_request("other", [1, 2, 3], params, group="call2")
    engine.add_request("elsewhere", [1, 2, 3], params, group="call3", client="b")
    engine.add_request("solo", [1, 2, 3], replace(params, n=1))
    reqs = {r.request_id.split("@")[0]: r for r in engine.scheduler.requests.values()}
    # 0: a client's first live sequence, 1: a call's, 2: the rest
    assert {k: (r.group, r.rank) for k, r in reqs.items()} == {
        "p0#0": ("call", 0),
        "p0#1": ("call", 2),
        "p1#0": ("call", 2),
        "p1#1": ("call", 2),
        "other#0": ("call2", 1),
        "other#1": ("call2", 2),
        "elsewhere#0": ("call3", 0),
        "elsewhere#1": ("call3", 2),
        "solo#0": (None, 0),
    }
    drain(engine, {})
    engine.startup.close()
