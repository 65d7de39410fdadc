"""Admission control and early input bounds: a call past the server's capacity is refused at
once (429, ``Retry-After``), a call past a per-call bound gets a 400 naming the limit, and
inputs too long for the context are refused from their size before any rendering or
tokenizing (each asserted fast, against a plain request timed in the same test)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server.admission import Admission, Overloaded
from warmboot.server.config import AdmissionLimits
from warmboot.server.engine_holder import EngineHolder

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("admission") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=256)
    limits = AdmissionLimits(
        max_num_seqs=1,
        max_queued_requests=0,
        max_prompts_per_request=8,
        max_prompt_logprob_tokens=64,
    )
    holder = EngineHolder.ready(llm.engine)
    with running_server(holder, admission=limits) as url:
        yield url, holder


@pytest.fixture()
def url(server):
    return server[0]


def _plain(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _in_flight(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    (line,) = [x for x in metrics.splitlines() if x.startswith("warmboot_sequences_in_flight ")]
    return float(line.split()[1])


def test_past_capacity_a_call_is_refused_at_once_and_capacity_comes_back(server):
    """Room for one sequence (one running, none queued): while one call holds it (the engine
    paused between steps), another is refused at once; calls streamed to the end or left
    mid-stream give their share back."""
    url, holder = server
    quiet = _plain(url)
    gate = threading.Event()
    pause = threading.Thread(target=asyncio.run, args=(holder.llm.call(lambda _: gate.wait(30)),))
    pause.start()
    with ThreadPoolExecutor(1) as pool:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
        first = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
        deadline = time.monotonic() + 10
        while _in_flight(url) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.perf_counter()
        refused = httpx.post(url + "/v1/completions", json=body)
        took = time.perf_counter() - t0
        gate.set()
        assert first.result().status_code == 200
    pause.join()
    assert took < 5 * quiet + 1.0
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "--max-queued-requests" in refused.json()["error"]["message"]
    assert (
        'warmboot_requests_rejected_total{bound="requests"} 1.0' in httpx.get(url + "/metrics").text
    )
    stream = {
        "model": MODEL_NAME,
        "prompt": "hi",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=stream) as r:
        assert r.status_code == 200 and len(list(r.iter_lines())) > 100
    with httpx.stream("POST", url + "/v1/completions", json=stream) as r:
        next(r.iter_lines())  # the client leaves mid-stream
    deadline = time.monotonic() + 10
    while _in_flight(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_flight(url) == 0, "every call gave its share back"
    _plain(url)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ["a"] * 9}, "prompt"),
        ({"prompt": ["a"] * 2, "n": 1, "max_tokens": 1}, "n"),
        ({"prompt": [7] * 100, "prompt_logprobs": 1, "max_tokens": 1}, "prompt_logprobs"),
    ],
)
def test_a_call_past_a_per_call_bound_is_a_400_naming_it(url, body, param):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "too large" in r.json()["error"]["message"]


def _big_inputs() -> dict[str, tuple[str, dict]]:
    text = "weather " * 480_000  # 3.8 MB
    hi = {"role": "user", "content": "hi"}
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": params}}
        for i in range(10_000)
    ]
    item = {"type": "message", "role": "user", "content": "hi"}
    return {
        "one long message": (CHAT, {"messages": [{"role": "user", "content": text}]}),
        "10^5 messages": (CHAT, {"messages": [{"role": "user", "content": ""}] * 100_000}),
        "10^4 tools": (CHAT, {"messages": [hi], "tools": tools}),
        "5x10^4 response items": ("/v1/responses", {"input": [item] * 50_000}),
        "tokenize 3.8 MB": ("/tokenize", {"prompt": text}),
    }


@pytest.mark.parametrize("case", list(_big_inputs()))
def test_inputs_too_long_for_the_context_are_refused_from_their_size(url, case):
    path, body = _big_inputs()[case]
    quiet = _plain(url)
    data = json.dumps({"model": MODEL_NAME, **body}).encode()
    t0 = time.perf_counter()
    r = httpx.post(url + path, content=data, timeout=60)
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text[:300]
    assert "too long" in r.json()["error"]["message"] or "cannot fit" in r.text
    assert took < 5 * quiet + 2.0, f"{case}: refused after {took:.2f}s"


def test_a_starting_server_says_when_to_retry(tmp_path):
    holder = EngineHolder(lambda: None)  # never booted
    with running_server(holder) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"


def test_the_token_bound_refuses_and_gives_back():
    admission = Admission(
        AdmissionLimits(max_num_seqs=1, max_queued_requests=1, max_queued_tokens=10)
    )
    ticket = admission.admit(1)
    ticket.add_tokens(6)
    other = admission.admit(1)
    with pytest.raises(Overloaded, match="--max-queued-tokens"):
        other.add_tokens(6)
    assert (admission.seqs, admission.tokens) == (1, 6), "the refused call holds nothing"
    ticket.release()
    ticket.release()
    assert (admission.seqs, admission.tokens) == (0, 0)
