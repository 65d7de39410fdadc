"""Clients in turn, end to end: one client's flood of streams (from 127.0.0.2) does not delay
another client's request (from 127.0.0.1), nor one that a trusted proxy's header names as
another client; a client holding half the capacity while others wait gets a 429. Latencies
against a quiet baseline measured in the same test."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server.admission import Admission, Overloaded
from warmboot.server.config import AdmissionLimits
from warmboot.server.engine_holder import EngineHolder

FLOOD = "127.0.0.2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("clients") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=512)
    with running_server(EngineHolder.ready(llm.engine), client_id_header="x-client") as url:
        yield url


def first_token_s(url: str, source: str = "127.0.0.1", headers=None) -> float:
    """Seconds to the first streamed token of a 1-token completion sent from ``source``."""
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "stream": True}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source)) as client:
        t0 = time.perf_counter()
        with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            next(line for line in r.iter_lines() if line.startswith("data: {"))
            return time.perf_counter() - t0


def flood(url: str, streams: int, stop: threading.Event) -> list[threading.Thread]:
    """``streams`` long streams from ``FLOOD``, each restarted until ``stop``."""
    body = {
        "model": MODEL_NAME,
        "prompt": "go",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }

    def run() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=FLOOD), timeout=60) as c:
            while not stop.is_set():
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def in_flight(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    (line,) = [x for x in metrics.splitlines() if x.startswith("warmboot_sequences_in_flight ")]
    return float(line.split()[1])


def test_a_flood_of_streams_from_one_client_does_not_delay_another(server):
    """16 streams of 200 tokens from one address hold the 4 seats and queue 12 more (minutes
    of work in turn); a request from another address, or one a proxy names as another
    client, gets its token about as fast as on a quiet server."""
    quiet = max(first_token_s(server) for _ in range(5))
    stop = threading.Event()
    threads = flood(server, 16, stop)
    try:
        deadline = time.monotonic() + 20
        while in_flight(server) < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert in_flight(server) >= 16
        other = [first_token_s(server) for _ in range(5)]
        proxied = [first_token_s(server, FLOOD, {"x-client": "b"}) for _ in range(3)]
        assert in_flight(server) >= 16, "the flood was still queued while the probes ran"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert max(other) < 3 * quiet + 0.5, (quiet, other)
    assert max(proxied) < 3 * quiet + 0.5, (quiet, proxied)


def test_a_client_holding_half_the_capacity_is_refused_while_others_wait():
    admission = Admission(AdmissionLimits(max_num_seqs=2, max_queued_requests=6))
    a = [admission.admit(1, "a") for _ in range(4)]  # alone: it may use more than half
    admission.admit(1, "a")
    b = admission.admit(1, "b")
    with pytest.raises(Overloaded, match="at most half"):
        admission.admit(1, "a")
    admission.admit(1, "b")  # b holds less than half
    b.release()
    for t in a:
        t.release()
    assert admission.by_client == {"a": 1, "b": 1}
