"""No request stalls the others: while a prompt as large as the body limit allows and a JSON
schema that takes seconds to compile are being handled, ``/health`` and an ordinary 1-token
request answer about as fast as when the server is idle."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

SLACK_S = 0.5


def _slow_schema() -> dict:
    """Within the grammar size limits, seconds to compile (a long enum)."""
    return {"enum": [f"{i:05d}-" + "abcdefghij" * 4 for i in range(6000)]}


@pytest.fixture(scope="module")
def url(path):
    llm = tiny_llm(path, max_num_seqs=4)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _one_token(url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


def _health(url: str) -> None:
    assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_a_huge_prompt_and_a_slow_schema_stall_nobody(url):
    idle = {
        name: min(_timed(lambda f=f: f(url)) for _ in range(3))
        for name, f in (("health", _health), ("one_token", _one_token))
    }
    huge = {"model": MODEL_NAME, "prompt": "word " * 700_000, "max_tokens": 1}  # 3.5 MB
    schema = {"type": "json_schema", "json_schema": {"name": "slow", "schema": _slow_schema()}}
    slow = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "response_format": schema,
    }
    answers: dict[str, int] = {}

    def send(name: str, path: str, body: dict) -> None:
        answers[name] = httpx.post(url + path, json=body, timeout=120).status_code

    heavy = [
        threading.Thread(target=send, args=("huge", "/v1/completions", huge)),
        threading.Thread(target=send, args=("schema", "/v1/chat/completions", slow)),
    ]
    for t in heavy:
        t.start()
    time.sleep(0.3)  # both are being handled now
    busy = {"health": _timed(lambda: _health(url)), "one_token": _timed(lambda: _one_token(url))}
    for t in heavy:
        t.join()
    assert answers == {"huge": 400, "schema": 200}, answers
    for name in busy:
        assert busy[name] < idle[name] + SLACK_S, (name, busy[name], idle[name])
