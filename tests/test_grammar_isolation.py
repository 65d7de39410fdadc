"""Grammar compiles run on their own bounded pool: plain validation never waits on them, specs
over the limits are refused up front, a caller waits at most its time limit, a caller that
leaves gives up its queued compile, identical compiles run once. The pool is driven with a
stand-in backend whose compiles block until released (timing without CPU load); the
validator and the limits with a real tokenizer and xgrammar."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from warmboot.core.errors import InvalidRequestError
from warmboot.device import grammar_compiles
from warmboot.device.grammar_backend import GrammarBackend
from warmboot.device.grammar_compiles import (
    GrammarCompileBusy,
    GrammarCompiles,
    GrammarCompileTimeout,
)
from warmboot.device.grammar_limits import GrammarLimits, GrammarTooLarge
from warmboot.device.grammar_requests import GrammarRequests
from warmboot.engine.validation import RequestValidator
from warmboot.sampling_params import SamplingParams, StructuredOutputs
from warmboot.tokenizer import Tokenizer
from warmboot.tokenizer.train import train_tokenizer

TOK_VOCAB = 512
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Compiled:
    def __init__(self, key):
        self.key = key


class SlowBackend:
    """Compiles block until ``release`` (or ``delay`` seconds); records what ran."""

    def __init__(self, delay: float | None = None):
        self.delay = delay
        self.gate = threading.Event()
        self.started: list[tuple] = []
        self.done: dict[tuple, Compiled] = {}
        self.cached_bytes = self.cached_grammars = self.cache_bytes = 0

    def lookup(self, key):
        return self.done.get(key)

    def compile_key(self, key):
        self.started.append(key)
        self.gate.wait(self.delay)
        return self.done.setdefault(key, Compiled(key))

    def release(self):
        self.gate.set()


def spec(i) -> StructuredOutputs:
    return StructuredOutputs(regex=f"x{i}")


def pool(backend, **kw) -> GrammarCompiles:
    compiles = GrammarCompiles(lambda: backend, workers=1, **kw)
    assert compiles.backend is backend
    return compiles


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("isolation-tok")
    train_tokenizer(path, TOK_VOCAB)
    return path


@pytest.fixture
def validator(tok_dir) -> RequestValidator:
    grammars = GrammarRequests(tok_dir / "tokenizer.json", TOK_VOCAB, (0,))
    return RequestValidator(Tokenizer.from_dir(tok_dir), TOK_VOCAB, 256, grammars)


# -- isolation -----------------------------------------------------------------------------
def test_plain_validation_is_not_delayed_by_busy_compiles(validator):
    """Six slow grammars (the issue's 279 s case) on a 2-thread default executor: plain
    requests validate as fast as on a quiet server."""
    slow = SlowBackend(delay=3.0)
    validator.compiles = pool(slow)
    plain = SamplingParams(max_tokens=4)
    structured = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=SCHEMA))

    async def plain_requests(n=20) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await asyncio.to_thread(validator.check, "hello there", plain)
        return time.perf_counter() - t0

    async def structured_request(i: int):
        params = SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputs(json={**SCHEMA, "title": str(i)})
        )
        checked = await asyncio.to_thread(validator.check, "hello", params)
        assert checked.needs_grammar
        return await validator.compile_async(checked)

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
        quiet = await plain_requests()
        slow_ones = [asyncio.create_task(structured_request(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        busy = await plain_requests()
        assert slow.started and not any(t.done() for t in slow_ones)  # compiles in progress
        for t in slow_ones:
            t.cancel()
        return quiet, busy

    quiet, busy = asyncio.run(main())
    assert busy < 5 * quiet + 0.5, (quiet, busy)
    checked = validator.check("hello", structured)
    assert checked.needs_grammar and checked.grammar is None


# -- limits --------------------------------------------------------------------------------
def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputs(json={"enum": [f"v{i}" for i in range(60_000)]}), "enum/const values"),
        (StructuredOutputs(json=nested(400)), "levels of nesting"),
        (StructuredOutputs(json='{"a": ' * 5000 + "1" + "}" * 5000), "levels of nesting"),
        (
            StructuredOutputs(
                json={"type": "object", "properties": {f"p{i}": {} for i in range(5001)}}
            ),
            "5001 object properties",
        ),
        (
            StructuredOutputs(
                json={
                    "type": "object",
                    "required": ["p0"],
                    "properties": {f"p{i}": {} for i in range(258)},
                }
            ),
            "257 optional properties in one object",
        ),
        (StructuredOutputs(regex="a" * (1 << 20) + "b"), "characters"),
        (StructuredOutputs(structural_tag=json.dumps({"x": nested(70)})), "levels of nesting"),
    ],
    ids=[
        "enum60k",
        "nested400",
        "nested5000-text",
        "properties",
        "optional",
        "regex-chars",
        "tag",
    ],
)
def test_specs_over_the_limits_are_refused_fast(validator, spec, words):
    t0 = time.perf_counter()
    with pytest.raises(GrammarTooLarge) as info:
        validator.check("hi", SamplingParams(max_tokens=2, structured_outputs=spec))
    assert time.perf_counter() - t0 < 2.0
    message = str(info.value)
    assert words in message and "the limit is" in message and "structured_outputs." in message
    assert isinstance(info.value, InvalidRequestError)  # the server's 400
    assert validator.compiles._backend is None  # nothing compiled, xgrammar not even loaded


def test_openai_sized_schemas_pass_the_limits(validator):
    """OpenAI's own maxima (5000 properties, 10 levels, 1000 enum values) are admitted."""
    names = [f"p{i}" for i in range(5000)]
    wide = {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": names,
    }
    deep = {"type": "array", "items": {"anyOf": [nested(10), {"type": "null"}]}}
    enum = {"enum": [f"value-{i}" for i in range(1000)]}
    for schema in (wide, deep, enum):
        assert validator.compiles.prepare(StructuredOutputs(json=schema))[0] == "json"
    limits = GrammarLimits()
    assert (limits.max_properties, limits.max_enum_values) == (5000, 10_000)


# -- time limit ----------------------------------------------------------------------------
def test_the_time_limit_fires_and_the_pool_goes_on():
    slow = SlowBackend()
    compiles = pool(slow)
    t0 = time.perf_counter()
    with pytest.raises(GrammarCompileTimeout, match=r"took longer than 0.3 s to compile"):
        compiles.compile(spec(1), timeout=0.3)
    assert 0.25 < time.perf_counter() - t0 < 2.0
    # The abandoned compile runs on; a stand-in worker takes the next one.
    second = compiles.submit(spec(2), timeout=5)
    wait_for(lambda: len(slow.started) == 2)
    assert compiles.stats()["abandoned"] == 1 and compiles.stats()["threads"] == 2
    # With the stand-in busy too, a third waits in the queue: its limit names that.
    with pytest.raises(GrammarCompileTimeout, match=r"within 0.2 s: the compile queue was busy"):
        compiles.compile(spec(3), timeout=0.2)
    slow.release()
    assert second.result(timeout=5).key == compiles.prepare(spec(2))
    # The abandoned result is cached: asking again is immediate.
    assert compiles.compile(spec(1), timeout=0.1).key == compiles.prepare(spec(1))
    wait_for(lambda: compiles.stats()["threads"] == 1)  # the stand-in retires
    assert compiles.counts["dropped"] == 1  # spec(3) never ran
    assert len(slow.started) == 2


def test_a_full_queue_is_refused():
    slow = SlowBackend()
    compiles = pool(slow, max_queued=2)
    # NOTE: the next two only once the first runs (else a loaded machine's worker may not
    # have taken it yet, and the third finds the queue full)
    tickets = [compiles.submit(spec(0), timeout=5)]
    wait_for(lambda: len(slow.started) == 1)
    tickets += [compiles.submit(spec(i), timeout=5) for i in (1, 2)]  # one runs, two wait
    with pytest.raises(GrammarCompileBusy, match="the limit is 2"):
        compiles.submit(spec(9))
    slow.release()
    assert [t.result(timeout=5).key[1] for t in tickets] == ["x0", "x1", "x2"]


# -- callers leaving -----------------------------------------------------------------------
def test_a_cancelled_queued_compile_never_runs():
    slow = SlowBackend()
    compiles = pool(slow)

    async def main():
        busy = asyncio.create_task(compiles.compile_async(spec(1), timeout=5))
        await asyncio.to_thread(wait_for, lambda: len(slow.started) == 1)
        gone = asyncio.create_task(compiles.compile_async(spec(2), timeout=5))
        await asyncio.sleep(0.05)
        assert compiles.stats()["queued"] == 1
        gone.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert compiles.stats()["queued"] == 0
        slow.release()
        return await busy

    assert asyncio.run(main()).key[1] == "x1"
    time.sleep(0.1)
    assert [k[1] for k in slow.started] == ["x1"]
    assert compiles.counts["dropped"] == 1


def test_a_compile_one_caller_left_still_serves_the_others():
    slow = SlowBackend()
    compiles = pool(slow)
    first, second = compiles.submit(spec(1), 5), compiles.submit(spec(1), 5)
    wait_for(lambda: len(slow.started) == 1)
    first.cancel()
    slow.release()
    assert second.result(timeout=5).key[1] == "x1"
    assert compiles.stats()["threads"] == 1


# -- sharing -------------------------------------------------------------------------------
def test_identical_concurrent_compiles_run_once():
    slow = SlowBackend()
    compiles = pool(slow)
    forms = [SCHEMA, dict(SCHEMA), json.dumps(SCHEMA), json.dumps(SCHEMA, indent=2)]

    async def main():
        tasks = [
            asyncio.create_task(compiles.compile_async(StructuredOutputs(json=s), timeout=5))
            for s in forms * 3
        ]
        await asyncio.to_thread(wait_for, lambda: slow.started)
        slow.release()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert len(slow.started) == 1 and all(r is results[0] for r in results)
    assert compiles.counts["compiled"] == 1


def test_real_compiles_are_shared_cached_and_found_by_the_engine(validator):
    """Through xgrammar: concurrent identical compiles run once; the engine's ``add`` finds
    the grammar that validation compiled; a bad schema is an InvalidRequestError."""
    grammars = validator.grammars
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json=SCHEMA))
    checked = validator.check("hi", params)
    assert checked.needs_grammar and grammars.compiles._backend is None
    with ThreadPoolExecutor(4) as ex:
        done = list(ex.map(lambda _: validator.compile(checked), range(4)))
    assert all(d.grammar is done[0].grammar for d in done) and not done[0].needs_grammar
    assert grammars.compiles.counts["compiled"] == 1
    grammars.add("r1", params.structured_outputs)
    assert grammars.compiles.counts["compiled"] == 1
    assert validator.validate("hi", params).grammar is done[0].grammar
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json={"type": "x"}))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs.json"):
        validator.validate("hi", bad)


def test_the_cache_is_bounded_in_bytes_but_grammars_in_use_stay_found(tok_dir):
    backend = GrammarBackend(tok_dir / "tokenizer.json", TOK_VOCAB, [0], cache_bytes=1)
    held = backend.compile(StructuredOutputs(regex="[a-z]{3}"))
    other = backend.compile(StructuredOutputs(regex="[0-9]{3}"))
    assert len(backend._cache) == 1 and backend.cached_bytes == other.nbytes
    assert backend.lookup(held.key) is held  # evicted, but a request still holds it
    key = held.key
    del held
    assert backend.lookup(key) is None


# -- lifetime ------------------------------------------------------------------------------
def test_close_fails_the_queue_and_waits_for_the_running_compile():
    slow = SlowBackend()
    compiles = pool(slow)
    running, queued = compiles.submit(spec(1), 5), compiles.submit(spec(2), 5)
    wait_for(lambda: len(slow.started) == 1)
    assert compiles.close(wait=0.05) is False  # still compiling
    with pytest.raises(GrammarCompileBusy, match="shut down"):
        queued.result(timeout=1)
    with pytest.raises(GrammarCompileBusy, match="shut down"):
        compiles.submit(spec(3))
    threading.Timer(0.1, slow.release).start()
    assert compiles.close(wait=5) is True and running.result(timeout=1).key[1] == "x1"


def test_an_idle_service_lets_its_threads_and_itself_go(monkeypatch):
    """No thread keeps a dropped engine's compile service (and its cache) alive."""
    monkeypatch.setattr(grammar_compiles, "IDLE_EXIT_S", 0.05)
    compiles = pool(SlowBackend(delay=0))
    compiles.compile(spec(1), timeout=0.2)
    ref = weakref.ref(compiles)
    del compiles
    wait_for(lambda: gc.collect() is not None and ref() is None, timeout=5)
