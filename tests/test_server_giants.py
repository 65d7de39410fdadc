"""Giant request bodies (issue 23): each is refused with the same 400 as before, found by the
body screening child (``body_parse``) rather than parsed on the event loop; a large body that
fits still goes through the app as before; and a burst of giants leaves a small streamed
request's time to first token near a quiet baseline measured in the same test."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server import body_parse, guard
from warmboot.server.engine_holder import EngineHolder

CHAT = "/v1/chat/completions"
BURST_S = 3.0


def _giants() -> dict[str, tuple[str, bytes]]:
    """The bench's giants (``bench.fairness.load_giants``), a little smaller."""
    msg = {"role": "user", "content": "hi"}
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    tools = [tool | {"function": tool["function"] | {"name": f"f{k}"}} for k in range(10_000)]
    item = {"type": "message", "role": "user", "content": "hi"}
    text = "word " * 600_000
    bodies = {
        "3 MB message": (CHAT, {"messages": [msg | {"content": text}], "max_tokens": 1}),
        "10^5 messages": (CHAT, {"messages": [msg] * 100_000, "max_tokens": 1}),
        "10^4 tools": (CHAT, {"messages": [msg], "tools": tools, "max_tokens": 1}),
        "6x10^4 response items": ("/v1/responses", {"input": [item] * 60_000, "store": False}),
        "tokenize 3 MB": ("/tokenize", {"prompt": text}),
    }
    return {case: (path, _json(body)) for case, (path, body) in bodies.items()}


def _json(body: dict) -> bytes:
    return json.dumps({"model": MODEL_NAME, **body}).encode()


def _other_refusals() -> dict[str, tuple[str, bytes]]:
    """Large bodies refused for what they hold: a bad role, a lone surrogate, another model."""
    hi = {"role": "user", "content": "hi"}
    bad_role = _json({"messages": [hi] * 99_999 + [hi | {"role": "robot"}]})
    surrogate = _json({"messages": [hi | {"content": "x" * 200_000 + "@"}]})
    other_model = _json({"messages": [hi] * 10_000}).replace(MODEL_NAME.encode(), b"other", 1)
    return {
        "a bad role among 10^5 messages": (CHAT, bad_role),
        "a lone surrogate escape": (CHAT, surrogate.replace(b"@", b"\\ud800")),
        "the wrong model": (CHAT, other_model),
    }


GIANTS = _giants()
OTHER_REFUSALS = _other_refusals()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("giants") / "model")
    with running_server(EngineHolder.ready(tiny_llm(model).engine)) as base:
        yield base


@pytest.fixture()
def screened(monkeypatch):
    """The statuses of the refusals the screening child found."""
    found, refusal = [], body_parse.Screen.refusal

    async def recorded(self, scope, facts, body):
        answer = await refusal(self, scope, facts, body)
        found.append(None if answer is None else answer[0])
        return answer

    monkeypatch.setattr(body_parse.Screen, "refusal", recorded)
    return found


def test_giants_are_refused_by_the_child_as_the_app_refuses_them(url, screened, monkeypatch):
    for case, (path, data) in (GIANTS | OTHER_REFUSALS).items():
        r = httpx.post(url + path, content=data, timeout=60)
        assert r.status_code in (400, 404) and screened[-1] == r.status_code, (case, r.text[:300])
        with monkeypatch.context() as m:  # NOTE: the app in this process, as before
            m.setattr(body_parse, "MIN_SCREEN_BYTES", 1 << 40)
            before = httpx.post(url + path, content=data, timeout=60)
        assert (before.status_code, before.content) == (r.status_code, r.content), case
        assert r.headers["content-type"] == before.headers["content-type"]
    assert len(screened) == len(GIANTS) + len(OTHER_REFUSALS)


def test_a_large_body_that_fits_goes_through_the_app(url, screened):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "user": "u" * (body_parse.MIN_SCREEN_BYTES * 2),
    }
    r = httpx.post(url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] == 2
    assert screened == [None]
    small = httpx.post(url + CHAT, json=body | {"user": "u"}, timeout=60)
    assert small.status_code == 200 and screened == [None], "small bodies are not screened"


def _ttft(url: str) -> float:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        took = time.perf_counter() - t0
        assert "data: [DONE]" in list(lines)
    return took


def _burst(url: str, stop: threading.Event, statuses: list) -> None:
    """Each giant sent again and again (one client each) until ``stop``."""

    def client(path: str, data: bytes) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                statuses.append(c.post(url + path, content=data).status_code)

    return [threading.Thread(target=client, args=g, daemon=True) for g in GIANTS.values()]


def test_a_small_request_stays_fast_beside_a_burst_of_giants(url):
    for _ in range(2):
        _ttft(url)  # NOTE: warm
    quiet = [_ttft(url) for _ in range(8)]
    stop, statuses = threading.Event(), []
    threads = _burst(url, stop, statuses)
    for t in threads:
        t.start()
    time.sleep(0.5)
    loaded, end = [], time.monotonic() + BURST_S
    while time.monotonic() < end:
        loaded.append(_ttft(url))
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(60)
    assert statuses and set(statuses) == {400}, statuses
    bound = 3 * max(quiet) + 0.25
    assert statistics.median(loaded) < bound and max(loaded) < bound + 0.5, (quiet, loaded)


def test_a_failing_child_leaves_the_body_to_the_app(url, screened, monkeypatch):
    path, data = OTHER_REFUSALS["the wrong model"]
    expected = httpx.post(url + path, content=data, timeout=60)
    assert expected.status_code == 404 and screened == [404]

    def broken(self, header, body):
        raise EOFError("the pipe closed")

    monkeypatch.setattr(body_parse._Child, "ask", broken)
    r = httpx.post(url + path, content=data, timeout=60)
    assert (r.status_code, r.content) == (404, expected.content) and screened == [404, None]


def test_past_the_waiting_bound_a_large_body_gets_a_429_at_once(url, monkeypatch):
    monkeypatch.setattr(guard, "MAX_WAITING", 0)  # as if the queue for the child were full
    path, data = GIANTS[next(iter(GIANTS))]
    r = httpx.post(url + path, content=data, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "large request bodies are waiting" in r.json()["error"]["message"]
    small = httpx.post(
        url + CHAT,
        json={
            "model": MODEL_NAME,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert small.status_code == 200, "small bodies do not wait for the child"
