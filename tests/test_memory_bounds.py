"""Memory a server keeps across requests stays bounded (issue 23; the long run is
``bench/soak.py``): the per-request state of the engine and the server is gone once a request
is (finished, abandoned mid-stream, refused), and the compiled-grammar cache keeps within its
byte bound, counting the spec text it is keyed by, and shows its size on ``/metrics``."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import assert_engine_clean
from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.device.grammar_backend import GrammarBackend
from warmboot.sampling_params import StructuredOutputs
from warmboot.server.engine_holder import EngineHolder
from warmboot.tokenizer.train import train_tokenizer

TOK_VOCAB = 512


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bounds-tok")
    train_tokenizer(path, TOK_VOCAB)
    return path


def described(i: int, chars: int) -> StructuredOutputs:
    """A distinct schema whose text is mostly a long description (tiny once compiled)."""
    props = {f"p{i}": {"type": "integer"}}
    return StructuredOutputs(
        json={"type": "object", "description": "d" * chars, "properties": props}
    )


def test_grammar_cache_counts_the_spec_text_within_its_byte_bound(tok_dir):
    bound = 1 << 20
    backend = GrammarBackend(tok_dir / "tokenizer.json", TOK_VOCAB, (0,), cache_bytes=bound)
    specs = [described(i, 200_000) for i in range(12)]
    for spec in specs:
        assert backend.compile(spec).nbytes > 200_000, "the key's text is counted"
    assert backend.cached_bytes <= bound
    assert 3 <= backend.cached_grammars < len(specs)
    assert backend.lookup(("json", json.dumps(specs[-1].json))) is not None
    assert backend.lookup(("json", json.dumps(specs[0].json))) is None, "LRU evicted first"


@pytest.fixture(scope="module")
def served(path):
    llm = tiny_llm(path, max_num_seqs=8)
    holder = EngineHolder.ready(llm.engine)
    with running_server(holder) as url:
        yield url, llm, holder


def post(url: str, path: str, body) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=data, headers=headers, timeout=30).status_code


def abandon_stream(url: str, i: int) -> int:
    """A 200-token stream left after its first chunk (the client goes away)."""
    body = {"model": MODEL_NAME, "prompt": f"story {i}", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_bytes())
        return r.status_code


def one(url: str, kind: str, i: int) -> int:
    if kind == "stream":
        return abandon_stream(url, i)
    if kind == "bad":
        return post(url, "/v1/completions", [b"{", {"model": MODEL_NAME, "max_tokens": -1}][i % 2])
    if kind == "schema":
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        return post(url, "/v1/chat/completions", body | {"max_tokens": 8, "response_format": fmt})
    return post(url, "/v1/completions", {"model": MODEL_NAME, "prompt": f"hi {i}", "max_tokens": 4})


def held(llm, holder) -> dict[str, int]:
    """The sizes of every per-request structure of the engine and its async front."""
    engine = llm.engine
    return {
        "streams": len(holder.llm._streams),
        "groups": len(engine.outputs.groups),
        "children": len(engine.outputs._child),
        "scheduled": len(engine.scheduler.requests),
        "matchers": len(engine.grammars.matchers),
        "blocks in use": engine.block_manager.num_used_blocks,
    }


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_per_request_state_goes_and_the_grammar_cache_stays_bounded(served):
    url, llm, holder = served
    backend = llm.engine.grammars.backend
    kinds = ["plain", "stream", "bad", "schema"]
    for rnd in range(2):
        jobs = [(k, rnd * 100 + i) for i in range(8) for k in kinds]
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda job: one(url, *job), jobs))
        assert sorted(set(codes)) == [200, 400]
        if rnd == 0:  # NOTE: the second round's 8 schemas must evict (LRU)
            backend.cache_bytes = backend.cached_bytes + backend.cached_bytes // 2
        deadline = time.monotonic() + 10
        while any(held(llm, holder).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(llm, holder) == dict.fromkeys(held(llm, holder), 0), f"round {rnd}"
        assert_engine_clean(llm)
    assert backend.cached_bytes <= backend.cache_bytes and backend.cached_grammars < 16
    text = httpx.get(url + "/metrics").text
    grammar = llm.engine.stats()["grammar"]
    assert metric(text, "warmboot_grammar_cache_bytes") == grammar["cached_bytes"] > 0
    assert metric(text, "warmboot_grammar_cache_entries") == backend.cached_grammars
    assert metric(text, "warmboot_grammar_cache_limit_bytes") == backend.cache_bytes
    assert metric(text, 'warmboot_grammar_compiles_total{outcome="compiled"}') == 16
    assert metric(text, "warmboot_sequences_in_flight") == 0
    stats = llm.engine.stats()
    kv = (
        stats["kv_blocks_total"] * llm.engine.block_manager.block_size * stats["kv_bytes_per_token"]
    )
    assert metric(text, "warmboot_kv_cache_bytes") == kv
