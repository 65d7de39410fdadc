"""The pipelined loop against the sync loop and transformers, and its pitfalls.

The pipelined loop overlaps forward(t+1) with the host's commit(t) and plan(t+2); rows may be
device-fed (their input token is still on the device), a request that ends at t leaves a zombie
row in t+1 whose blocks and slot are held until t+1 retires, and two steps are in flight over
two ping-pong buffers. These tests drive both loops with the same deterministic step counter
and check that what users see is identical, that nothing leaks past an abort, a stop string or
EOS, and that the block pool and request slots stay consistent after every step.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_engine_clean, hf_greedy, random_prompts, stop_window
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.core.types import SchedulerOutput

TEXT_PROMPT = "Hello world, this is a test"
MAX_STEPS = 3000


@pytest.fixture(scope="module", autouse=True)
def _restore_threads():
    """Every LLM here is built with ``cpu_threads=1`` (a global torch setting): restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_llm(path, pipelined: bool, **kw) -> LLM:
    args = dict(
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        cpu_threads=1,
    )
    args.update(kw)
    return LLM(str(path), pipelined=pipelined, **args)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def rows_of(handle) -> list[str]:
    return [] if handle is None else [s.req_id for s in handle.sched.scheduled]


def step_checked(engine):
    outs = engine.step()
    engine.block_manager.check_invariants()
    return outs


def run_to_end(engine, outputs: dict[str, list]) -> None:
    """Step until idle (a pipelined engine may still have a step in flight after the last
    output), checking the pool after every step; every output is appended per request."""
    n = 0
    while engine.has_unfinished_requests():
        for out in step_checked(engine):
            outputs.setdefault(out.request_id, []).append(out)
        n += 1
        assert n < MAX_STEPS, "the engine does not make progress"


# -- a workload both loops run with the same step counter ----------------------------------------
@dataclass(frozen=True)
class Req:
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int
    """Added before this ``step()`` call (0-based)."""
    abort_at: int | None = None
    """Aborted before this ``step()`` call, i.e. after the same number of commits in both
    loops (each ``step()`` commits exactly one step in either loop)."""


def drive(llm: LLM, reqs: list[Req]) -> dict[str, object]:
    """Run ``reqs`` on ``llm``; return each request's final output. Checks after every step:
    pool invariants, nothing is output for a request after its final output, and each request
    gets exactly one final output."""
    engine = llm.engine
    finals: dict[str, object] = {}
    last_event = max([r.arrival for r in reqs] + [r.abort_at or 0 for r in reqs])
    k = 0
    while k <= last_event or engine.has_unfinished_requests():
        for r in reqs:
            if r.arrival == k:
                engine.add_request(r.rid, {"prompt_token_ids": list(r.prompt)}, r.params)
            if r.abort_at == k:
                engine.abort_request(r.rid)
        for out in step_checked(engine):
            assert out.request_id not in finals, f"{out.request_id}: output after its final one"
            if out.finished:
                finals[out.request_id] = out
        k += 1
        assert k < MAX_STEPS, "the engine does not make progress"
    assert set(finals) == {r.rid for r in reqs}
    assert_engine_clean(llm)
    return finals


def _is_prefix(a: list, b: list) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def compare_runs(reqs: list[Req], sync: dict, pipe: dict, tok) -> Counter:
    """Per request id and completion: equal results, except where one loop aborted (the abort
    lands at the same commit index, but the pipelined loop schedules a new arrival one step
    later and can be at a different position): then the token streams must agree on their
    common prefix, and the aborted text must be a prefix of its own tokens' text."""
    seen: Counter = Counter()
    for r in reqs:
        a, b = sync[r.rid], pipe[r.rid]
        assert len(a.outputs) == len(b.outputs) == r.params.n
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            where = f"{r.rid}[{ca.index}] {r.params}"
            if "abort" in (ca.finish_reason, cb.finish_reason):
                assert r.abort_at is not None, where
                seen["aborted"] += 1
                short, long = sorted([ca.token_ids, cb.token_ids], key=len)
                assert _is_prefix(short, long), where
                for c in (ca, cb):
                    if c.finish_reason == "abort":
                        assert tok.decode(c.token_ids).startswith(c.text), where
                continue
            seen[cb.finish_reason] += 1
            assert cb.token_ids == ca.token_ids, where
            assert cb.text == ca.text, where
            assert (cb.finish_reason, cb.stop_reason) == (ca.finish_reason, ca.stop_reason), where
            if isinstance(ca.stop_reason, str):
                seen["stop_string"] += 1
            elif isinstance(ca.stop_reason, int):
                seen["stop_token"] += 1
            if r.params.logprobs is not None:
                assert len(ca.logprobs) == len(cb.logprobs) == len(ca.token_ids), where
                for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert set(da) == set(db), where
                    for t in da:
                        assert abs(da[t].logprob - db[t].logprob) < 1e-4, where
    return seen


# -- 1. exactness: pipelined == sync on random workloads -----------------------------------------
MAX_MODEL_LEN = 64  # prompt <= 40 + max_tokens <= 20 fits; a 16-block pool is then allowed
KINDS = ("greedy", "seeded", "penalties", "logprobs", "repeat")
"""``repeat``: penalties that reward repeating the output, so the newest token of the history
(committed just before the sample is enqueued) changes the choice."""


@st.composite
def workloads(draw):
    n_req = draw(st.integers(1, 6))
    reqs = []
    for i in range(n_req):
        length = draw(st.sampled_from([3, 17, 40]) | st.integers(1, 40))
        variant = draw(st.integers(0, 1))
        arrival = draw(st.integers(0, 6))
        abort = draw(st.integers(0, 15)) if draw(st.integers(0, 3)) == 0 else None
        reqs.append(
            dict(
                rid=f"r{i}",
                length=length,
                variant=variant,
                kind=draw(st.sampled_from(KINDS)),
                max_tokens=draw(st.integers(1, 20)),
                n=draw(st.sampled_from([1, 1, 2])),
                stop=draw(st.none() | st.tuples(st.integers(0, 200), st.integers(1, 4))),
                stop_token=draw(st.none() | st.integers(0, 19)),
                min_tokens=draw(st.sampled_from([0, 0, 0, 3, "at_stop"])),
                ignore_eos=draw(st.booleans()),
                seed=draw(st.integers(0, 1000)),
                arrival=arrival,
                abort_at=None if abort is None else arrival + abort,
            )
        )
    small_pool = draw(st.booleans())
    engine = dict(
        num_kv_blocks=draw(st.sampled_from([16, 17, 18])) if small_pool else 128,
        max_num_batched_tokens=draw(st.integers(4, 32)),
        max_num_seqs=draw(st.sampled_from([3, 16])),
        enable_prefix_caching=draw(st.booleans()),
    )
    return reqs, engine


def _spec(i, length, kind, max_tokens, n=1, stop=None, arrival=0, abort_at=None) -> dict:
    return dict(
        rid=f"r{i}",
        length=length,
        variant=0,
        kind=kind,
        max_tokens=max_tokens,
        n=n,
        stop=stop,
        ignore_eos=True,
        seed=i,
        arrival=arrival,
        abort_at=abort_at,
        stop_token=None,
        min_tokens=0,
    )


# Five long requests in a 16-block pool (64 tokens): both loops must preempt.
HEAVY = (
    [
        _spec(0, 40, "greedy", 20),
        _spec(1, 30, "seeded", 20, n=2),
        _spec(2, 25, "penalties", 20, stop=(10, 2), arrival=1),
        _spec(3, 20, "logprobs", 20, arrival=2),
        _spec(4, 35, "greedy", 20, arrival=3, abort_at=12),
    ],
    dict(num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=16, enable_prefix_caching=True),
)


def _prompt(length: int, variant: int) -> tuple[int, ...]:
    return tuple(random_prompts([length], VOCAB_SIZE, seed=1000 * variant + length)[0])


def _build(spec: dict, greedy_ref) -> Req:
    """``greedy_ref(prompt)``: (text, token ids) of a greedy 20-token continuation; stop strings
    and stop token ids are taken from it, so greedy requests actually hit them."""
    prompt = _prompt(spec["length"], spec["variant"])
    text, ids = greedy_ref(prompt)
    stop: tuple[str, ...] = ()
    if spec["stop"] is not None and text:
        offset, size = spec["stop"]
        offset %= len(text)
        stop = (text[offset : offset + size],)
    stop_ids = () if spec["stop_token"] is None else (ids[spec["stop_token"]],)
    min_tokens = spec["min_tokens"]
    if min_tokens == "at_stop":  # the stop token comes exactly when it stops being suppressed
        min_tokens = spec["stop_token"] or 0
    common = dict(
        max_tokens=spec["max_tokens"],
        min_tokens=min(min_tokens, spec["max_tokens"]),
        n=spec["n"],
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=spec["ignore_eos"],
    )
    kind = spec["kind"]
    if kind == "seeded":
        top_k = 20 if spec["seed"] % 2 else 0  # the top-k candidates path, or the full sort
        params = SamplingParams(
            temperature=0.9, top_p=0.9, top_k=top_k, seed=spec["seed"], **common
        )
    elif kind == "penalties":
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            **common,
        )
    elif kind == "repeat":
        params = SamplingParams(
            temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1.0, **common
        )
    elif kind == "logprobs":
        bias = {spec["seed"] % 64: 4.0, 3: -2.0}
        params = SamplingParams(temperature=0.0, logprobs=2, logit_bias=bias, **common)
    else:
        params = SamplingParams(temperature=0.0, **common)
    return Req(spec["rid"], prompt, params, spec["arrival"], spec["abort_at"])


def greedy_reference(path):
    """(tokenizer, prompt -> (text, ids) of a cached greedy 20-token continuation)."""
    ref = make_llm(path, pipelined=False, max_model_len=MAX_MODEL_LEN)

    @functools.cache
    def greedy_ref(prompt: tuple[int, ...]) -> tuple[str, list[int]]:
        out = ref.generate({"prompt_token_ids": list(prompt)}, greedy(20, ignore_eos=True))
        return out[0].outputs[0].text, out[0].outputs[0].token_ids

    return ref.get_tokenizer(), greedy_ref


def workload_settings(max_examples: int):
    """Deterministic examples (the coverage assertions depend on them)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def test_pipelined_equals_sync_on_random_workloads(path):
    tok, greedy_ref = greedy_reference(path)
    coverage: Counter = Counter()

    @workload_settings(12)
    @given(workloads())
    @example(HEAVY)
    def check(workload):
        specs, engine_kw = workload
        reqs = [_build(s, greedy_ref) for s in specs]
        results = {}
        for pipelined in (False, True):
            llm = make_llm(path, pipelined, max_model_len=MAX_MODEL_LEN, **engine_kw)
            assert llm.stats()["loop"] == ("pipelined" if pipelined else "sync")
            results[pipelined] = drive(llm, reqs)
            coverage[f"preempted_{pipelined}"] += llm.stats()["preemptions"] > 0
        coverage.update(compare_runs(reqs, results[False], results[True], tok))

    check()
    # The examples (fixed by derandomize) exercise what the test is about.
    assert coverage["preempted_True"] > 0 and coverage["preempted_False"] > 0, coverage
    assert coverage["aborted"] > 0 and coverage["stop_string"] > 0, coverage
    assert coverage["stop_token"] > 0, coverage
    assert coverage["length"] > 0, coverage


def test_pipelined_equals_sync_with_compiled_steps(path, compiled_default):
    """The heavy workload (preemption, aborts, stops, penalties) through the compiled steps:
    both loops give the same outputs, and the same as the eager reference."""
    tok, greedy_ref = greedy_reference(path)
    specs, engine_kw = HEAVY
    reqs = [_build(s, greedy_ref) for s in specs]
    results = {}
    for pipelined in (False, True):
        llm = make_llm(path, pipelined, max_model_len=MAX_MODEL_LEN, **engine_kw)
        assert llm.stats()["compile"]["compiled"], llm.stats()["compile"]
        results[pipelined] = drive(llm, reqs)
        assert llm.stats()["compile"]["graphs"] == 2, "a step recompiled while serving"
    assert compare_runs(reqs, results[False], results[True], tok)


# -- 2. abort of a request whose token is in flight ----------------------------------------------
def test_abort_of_in_flight_request(path, hf):
    llm = make_llm(path, pipelined=True)
    engine = llm.engine
    prompts = random_prompts([7, 12, 5], VOCAB_SIZE, seed=41)
    params = greedy(20, ignore_eos=True)
    for name, p in zip("abc", prompts, strict=True):
        engine.add_request(name, {"prompt_token_ids": p}, params)
    outputs: dict[str, list] = {}
    for _ in range(4):
        for out in step_checked(engine):
            outputs.setdefault(out.request_id, []).append(out)
    # b has a sampled-not-committed row and a forwarded-not-sampled row in flight.
    (b_id,) = engine.outputs.child_ids("b")  # the scheduler's id of b's one completion
    assert b_id in rows_of(engine.loop.forwarded)
    assert b_id in rows_of(engine.loop.sampled)
    state = engine.outputs.groups["b"].completions[0]
    tokens_at_abort, text_at_abort = list(state.token_ids), state.text
    assert 0 < len(tokens_at_abort) < 20
    n_before = len(outputs["b"])

    committed_zombies = []
    update = engine.scheduler.update

    def spy(sched, result):
        committed_zombies.extend(rid for rid in result.req_ids if rid == b_id)
        return update(sched, result)

    engine.scheduler.update = spy
    engine.abort_request("b")
    engine.block_manager.check_invariants()
    run_to_end(engine, outputs)

    assert committed_zombies == [b_id, b_id], "both in-flight rows of b retire as zombies"
    after = outputs["b"][n_before:]
    assert len(after) == 1, "exactly one (final) output after the abort"
    (b,) = after[0].outputs
    assert after[0].finished and b.finish_reason == "abort"
    assert b.token_ids == tokens_at_abort and b.text == text_at_abort
    assert tokens_at_abort == hf_greedy(hf, prompts[1], 20)[: len(tokens_at_abort)]
    for name, p in zip("ac", [prompts[0], prompts[2]], strict=True):
        final = outputs[name][-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == hf_greedy(hf, p, 20), name
    assert_engine_clean(llm)


# -- 3. a stop string found one step late --------------------------------------------------------
@pytest.fixture(scope="module")
def base_text(path):
    llm = make_llm(path, pipelined=False)
    out = llm.generate(TEXT_PROMPT, greedy(30))[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length", "precondition: no EOS"
    return out.text


def _stream(llm, params, prompts) -> tuple[dict, dict, dict]:
    """Stream several requests (cumulative outputs); return per request the concatenated
    deltas, the final output, and (pipelined) whether the request had a row in the step in
    flight when its final output came (a zombie)."""
    engine = llm.engine
    child = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
        (child[f"s{i}"],) = engine.outputs.child_ids(f"s{i}")
    deltas: dict[str, str] = {}
    finals: dict = {}
    zombie_at_finish: dict[str, bool] = {}
    n = 0
    while engine.has_unfinished_requests():
        for out in step_checked(engine):
            (c,) = out.outputs
            assert out.request_id not in finals
            for stop in params.stop:
                assert stop not in c.delta_text and stop not in c.text
            deltas[out.request_id] = deltas.get(out.request_id, "") + c.delta_text
            assert c.text == deltas[out.request_id]
            if out.finished:
                finals[out.request_id] = out
                if engine.pipelined:
                    zombie = child[out.request_id] in rows_of(engine.loop.sampled)
                    zombie_at_finish[out.request_id] = zombie
        n += 1
        assert n < MAX_STEPS
    assert_engine_clean(llm)
    return deltas, finals, zombie_at_finish


@pytest.mark.parametrize("size", [4, 7])
def test_stop_string_found_one_step_late(path, base_text, size):
    i, stop = stop_window(base_text, len(base_text) // 3, size)
    params = greedy(30, stop=[stop])
    prompts = [TEXT_PROMPT, TEXT_PROMPT + " again"]
    sync_deltas, sync_finals, _ = _stream(make_llm(path, False), params, prompts)
    pipe_llm = make_llm(path, True)
    deltas, finals, zombies = _stream(pipe_llm, params, prompts)
    assert sync_finals["s0"].outputs[0].text == base_text[:i]
    assert sync_deltas["s0"] == base_text[:i]
    assert deltas == sync_deltas
    for rid, out in finals.items():
        (c,), (ref,) = out.outputs, sync_finals[rid].outputs
        assert (c.text, c.token_ids) == (ref.text, ref.token_ids)
        assert (c.finish_reason, c.stop_reason) == (ref.finish_reason, ref.stop_reason)
    assert finals["s0"].outputs[0].stop_reason == stop
    # The stop was seen while the request's next row was already launched (a zombie).
    assert zombies["s0"]


# -- 4. no row launched past max_tokens ----------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [[12, 12, 12, 12], [1, 2, 5, 12]])
def test_no_wasted_rows_at_max_tokens(path, hf, max_tokens):
    prompts = random_prompts([5, 9, 13, 17], VOCAB_SIZE, seed=43)
    launched = {}
    for pipelined in (False, True):
        llm = make_llm(path, pipelined, max_num_batched_tokens=64)  # every prompt: one chunk
        engine = llm.engine
        before = llm.stats()["launched_rows"]
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(n, ignore_eos=True))
        outputs: dict[str, list] = {}
        run_to_end(engine, outputs)
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            c = outputs[f"r{i}"][-1].outputs[0]
            assert c.finish_reason == "length" and c.token_ids == hf_greedy(hf, p, n)
        assert llm.stats()["preemptions"] == 0
        launched[pipelined] = llm.stats()["launched_rows"] - before
        assert_engine_clean(llm)
    # One prefill row per request (one chunk) plus max_tokens - 1 decode rows.
    expected = sum(1 + (n - 1) for n in max_tokens)
    assert launched[False] == expected
    assert launched[True] == launched[False]


# -- 5. zombies after EOS ------------------------------------------------------------------------
def test_zombie_after_eos_holds_blocks_until_retired(path, tmp_path):
    probe = make_llm(path, pipelined=False)
    prompts = random_prompts([6] * 20, VOCAB_SIZE, seed=21)
    outs = probe.generate([{"prompt_token_ids": p} for p in prompts], greedy(16, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        ids = o.outputs[0].token_ids
        if 0 not in ids[:5] and ids[4] not in ids[:4]:
            prompt, e = p, ids[4]
            break
    else:
        raise AssertionError("precondition: no prompt with a new 5th greedy token")
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    gen_file = eos_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen["eos_token_id"] = e
    gen_file.write_text(json.dumps(gen))

    sync = make_llm(eos_dir, pipelined=False).generate({"prompt_token_ids": prompt}, greedy(16))
    assert sync[0].outputs[0].token_ids == ids[:5]

    llm = make_llm(eos_dir, pipelined=True)
    engine, kv = llm.engine, llm.engine.block_manager
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(16))
    (child,) = engine.outputs.child_ids("r")
    table: list[int] = []
    final = None
    for _ in range(20):
        table = list(kv.block_table(child)) or table
        outs = step_checked(engine)
        if outs and outs[0].finished:
            final = outs[0]
            break
    assert final is not None
    (c,) = final.outputs
    assert c.token_ids == ids[:5] and c.token_ids[-1] == e
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.text == sync[0].outputs[0].text
    # The request is gone, but its row in the step now in flight is a zombie holding its blocks.
    assert child in rows_of(engine.loop.sampled)
    assert child not in engine.scheduler.requests
    assert kv.block_table(child) == []
    assert table and all(kv.blocks[b].ref_count > 0 and kv.holds(b) > 0 for b in table)
    assert kv.num_used_blocks == len(table)
    assert engine.has_unfinished_requests(), "the zombie step is still in flight"
    # The next commit retires it: the zombie's token is dropped, the blocks come back.
    later = []
    while engine.has_unfinished_requests():
        later += step_checked(engine)
    assert later == [], "nothing is output for the finished request, not the zombie's token"
    assert kv.num_held_blocks == 0 and kv.num_used_blocks == 0
    assert all(kv.blocks[b].ref_count == 0 for b in table)
    assert_engine_clean(llm)


# -- 6. no ping-pong buffer or request slot reused while a step is in flight ---------------------
def _mixed_workload(greedy_ref) -> list[Req]:
    specs = []
    lengths = [3, 11, 25, 40, 8, 19, 30, 6]
    kinds = ["greedy", "greedy", "seeded", "penalties", "logprobs", "repeat", "seeded", "repeat"]
    for i, (length, kind) in enumerate(zip(lengths, kinds, strict=True)):
        specs.append(
            dict(
                rid=f"m{i}",
                length=length,
                variant=i % 2,
                kind=kind,
                max_tokens=8 + (3 * i) % 13,
                n=2 if i == 5 else 1,
                stop=(7 * i, 3) if i % 3 == 0 else None,
                ignore_eos=i % 2 == 0,
                seed=i,
                arrival=(2 * i) % 7,
                abort_at=9 if i == 2 else None,
                stop_token=5 if i in (1, 4) else None,
                min_tokens={7: 3, 1: "at_stop"}.get(i, 0),
            )
        )
    return [_build(s, greedy_ref) for s in specs]


def test_ping_pong_buffers_and_slots_never_reused_in_flight(path, monkeypatch):
    ref = make_llm(path, pipelined=False, max_model_len=MAX_MODEL_LEN)

    def greedy_ref(prompt):
        out = ref.generate({"prompt_token_ids": list(prompt)}, greedy(20, ignore_eos=True))
        return out[0].outputs[0].text, out[0].outputs[0].token_ids

    reqs = _mixed_workload(greedy_ref)
    kw = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=20, max_num_batched_tokens=12)
    sync = drive(make_llm(path, False, **kw), reqs)

    llm = make_llm(path, True, **kw)
    runner = llm.engine.runner
    prepare = runner.prepare_step
    seen = Counter()

    def in_flight() -> list:
        return runner.in_flight()

    def checked(sched):
        # check_invariants: in-flight steps use distinct working sets and their inputs live
        # in them; every row of an in-flight step owns a live slot no other request has.
        runner.check_invariants()
        assert len(in_flight()) <= 1
        handle = prepare(sched)
        runner.check_invariants()
        seen["steps"] += 1
        seen["two_in_flight"] += len(in_flight()) == 2
        seen["staged"] += handle.inputs is not None
        return handle

    monkeypatch.setattr(runner, "prepare_step", checked)
    pipe = drive(llm, reqs)
    assert seen["steps"] > 30 and seen["two_in_flight"] > 20 and seen["staged"] > 20, seen
    assert llm.stats()["preemptions"] > 0
    tok = llm.get_tokenizer()
    compare_runs(reqs, sync, pipe, tok)

    # Provoked reuse: mid-flight (two steps in flight) one more launch hits the assertion...
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, greedy(10, ignore_eos=True))
    engine.add_request("y", {"prompt_token_ids": [8, 9]}, greedy(10, ignore_eos=True))
    step_checked(engine)
    assert len(in_flight()) == 2
    with pytest.raises(AssertionError, match="ping-pong"):
        prepare(SchedulerOutput())
    outputs: dict[str, list] = {}
    run_to_end(engine, outputs)  # ...which changed nothing: the engine carries on
    assert outputs["x"][-1].outputs[0].finish_reason == "length"
    assert_engine_clean(llm)
    # ...and when idle, two launches without collecting fill both buffers; a third raises.
    first, second = prepare(SchedulerOutput()), prepare(SchedulerOutput())
    with pytest.raises(AssertionError, match="ping-pong"):
        prepare(SchedulerOutput())
    for h in (first, second):
        runner.launch_sample(h)
        runner.collect(h)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == outputs["x"][-1].outputs[0].token_ids
    assert_engine_clean(llm)


# -- 7. device-fed tokens ------------------------------------------------------------------------
def test_device_fed_rows_in_steady_decode(path, hf):
    prompts = random_prompts([9, 4, 15], VOCAB_SIZE, seed=47)
    fed = Counter()
    llms = {p: make_llm(path, p) for p in (False, True)}
    for pipelined, llm in llms.items():
        engine = llm.engine
        submit = engine.runner.submit_forward

        def spy(handle, _submit=submit, _p=pipelined):
            for s in handle.inputs.rows if handle.inputs else ():
                fed[_p, s.device_fed] += 1
            return _submit(handle)

        engine.runner.submit_forward = spy
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(16, ignore_eos=True))
        outputs: dict[str, list] = {}
        steady = 0
        while engine.has_unfinished_requests():
            for out in step_checked(engine):
                outputs.setdefault(out.request_id, []).append(out)
            if pipelined and len(rows_of(engine.loop.forwarded)) == 3:
                # Every decode row's input is the token sampled by the step still in flight.
                for s in engine.loop.forwarded.sched.scheduled:
                    assert s.num_tokens == 1 and s.device_fed and s.token_ids == [-1]
                steady += 1
        for i, p in enumerate(prompts):
            assert outputs[f"r{i}"][-1].outputs[0].token_ids == hf_greedy(hf, p, 16)
        assert_engine_clean(llm)
    assert steady >= 10
    assert fed[False, True] == 0, "the sync loop knows every input token on the host"
    # Pipelined: every decode row is device-fed (3 requests x 15 decode rows).
    assert fed[True, True] == 3 * 15 and fed[True, False] == 3


# -- 8. bubble meter -----------------------------------------------------------------------------
def _bubble(path, pipelined: bool, prompts, params) -> tuple[float, list]:
    llm = make_llm(path, pipelined, num_kv_blocks=128)  # no preemption: pure decode
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.stats()
    assert stats["decode_steps_measured"] >= 39  # the 39 decode-only commits of the run
    bubble = stats["bubble_fraction"]
    assert isinstance(bubble, float) and 0.0 <= bubble <= 1.0
    assert_engine_clean(llm)
    return bubble, [o.outputs[0].token_ids for o in outs]


def test_bubble_fraction_is_smaller_pipelined(path):
    """Sync leaves the device idle during every host phase (schedule, prepare, commit); the
    pipelined loop overlaps them with the next forward. Unloaded 2-core machine: ~0.3 vs ~0.03.
    On an overloaded machine (other test processes) both approach 1 and a single pair of runs
    can invert by noise (seen: 0.747 vs 0.743 with 6 busy processes on 2 cores), so up to three
    fresh pairs are measured and one must show the pipelined loop ahead. A loop without overlap,
    or a meter that does not measure device idle time, fails all three."""
    prompts = random_prompts([8] * 8, VOCAB_SIZE, seed=53)
    params = greedy(40, ignore_eos=True)
    pairs = []
    for _ in range(3):
        (sync, sync_ids), (pipe, pipe_ids) = (
            _bubble(path, p, prompts, params) for p in (False, True)
        )
        assert pipe_ids == sync_ids
        pairs.append((sync, pipe))
        if sync > pipe:
            break
    else:
        raise AssertionError(f"pipelined bubble never below sync: {pairs}")


# -- 9. preemption while a token is in flight ----------------------------------------------------
def test_preemption_with_token_in_flight(path, hf):
    prompts = random_prompts([10, 20, 30, 15, 25], VOCAB_SIZE, seed=59)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)
    params = [greedy(20, ignore_eos=True)] * 3 + [seeded, seeded]
    llm = make_llm(
        path, True, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=8
    )
    engine = llm.engine
    preempted_in_flight = []
    prepare = engine.runner.prepare_step

    def spy(sched):  # a step's preempted requests, seen as the runner receives it
        for rid in sched.preempted_req_ids:
            req = engine.scheduler.requests.get(rid)
            if req is not None and req.num_inflight:
                preempted_in_flight.append(rid)
        return prepare(sched)

    engine.runner.prepare_step = spy
    children = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        (children[f"r{i}"],) = engine.outputs.child_ids(f"r{i}")
    outputs: dict[str, list] = {}
    run_to_end(engine, outputs)
    assert preempted_in_flight, "precondition: a request was preempted with its token in flight"
    seeded_ids = {children["r3"], children["r4"]}
    assert seeded_ids & set(preempted_in_flight), "precondition: a seeded one among them"
    for i in range(3):
        c = outputs[f"r{i}"][-1].outputs[0]
        assert c.finish_reason == "length"
        assert c.token_ids == hf_greedy(hf, prompts[i], 20), f"r{i}"
    assert_engine_clean(llm)
    # Seeded streams go on through preemption: same tokens as a sync run that never preempts.
    big = make_llm(path, False, max_model_len=64, num_kv_blocks=128)
    ref = big.generate([{"prompt_token_ids": p} for p in prompts[3:]], seeded)
    assert big.stats()["preemptions"] == 0
    for i, r in zip((3, 4), ref, strict=True):
        assert outputs[f"r{i}"][-1].outputs[0].token_ids == r.outputs[0].token_ids, f"r{i}"


# -- 10. a request id reused right after its final output ----------------------------------------
# Regression: the final output can come while a zombie row of the request is still in flight; a
# new request reusing the id must not receive that zombie's token, slot or seeded generator.
@pytest.mark.parametrize("how", ["abort", "stop_token"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_request_id_reused_right_after_its_final_output(path, pipelined, how):
    llm = make_llm(path, pipelined)
    engine = llm.engine
    prompt = {"prompt_token_ids": [5, 6, 7]}
    if how == "abort":
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
        expected = llm.generate(prompt, params)[0].outputs[0].token_ids
    else:
        base = llm.generate(prompt, greedy(10, ignore_eos=True))[0].outputs[0].token_ids
        assert base[3] not in base[:3], "precondition"
        params = greedy(10, ignore_eos=True, stop_token_ids=[base[3]])
        expected = base[:4]
    engine.add_request("r", prompt, params)
    if how == "abort":
        for _ in range(2):
            step_checked(engine)
        engine.abort_request("r")
    final = None
    while final is None:
        final = next((o for o in step_checked(engine) if o.finished), None)
    assert final.outputs[0].finish_reason == ("abort" if how == "abort" else "stop")
    assert not pipelined or engine.loop.in_flight(), "precondition: a zombie row is in flight"
    # The final output was delivered: the id is free again (the sync loop allows this).
    engine.add_request("r", prompt, params)
    outputs: dict[str, list] = {}
    run_to_end(engine, outputs)
    assert outputs["r"][-1].outputs[0].token_ids == expected
    assert_engine_clean(llm)


# -- 11. preemption in the pipelined loop does not cascade ---------------------------------------
@pytest.mark.parametrize(
    "pipelined",
    [False, True],
)
def test_one_missing_block_does_not_preempt_the_whole_batch(path, pipelined):
    # 8 x (8 + 40) tokens need 96 blocks; 64 force a few preemptions late in the run.
    prompts = random_prompts([8] * 8, VOCAB_SIZE, seed=53)
    llm = make_llm(path, pipelined, num_kv_blocks=64, max_num_batched_tokens=64)
    sched = llm.engine.scheduler
    schedule = sched.schedule
    preemptions = []

    def spy():
        running = len(sched.running)
        out = schedule()
        if out.preempted_req_ids:
            preemptions.append((running, len(out.preempted_req_ids)))
        return out

    sched.schedule = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(40, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert preemptions, "precondition: the pool is too small for the whole batch"
    # Sync: each shortage preempts one request (the last), here 3 in all.
    assert all(n < running for running, n in preemptions), preemptions
    assert llm.stats()["preemptions"] <= 6, preemptions
    assert_engine_clean(llm)
