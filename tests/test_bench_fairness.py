"""bench/fairness.py's parts that need no model server: the raw HTTP client against a stdlib
server, the loads' bodies, the percentiles, the flags."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import fairness as f


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # NOTE: keep the test output quiet
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/bad":
            body = json.dumps({"error": {"message": "too big", "code": 400}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(3):
            time.sleep(0.05)
            self.wfile.write(f'data: {{"choices": [{{"text": "{i}"}}]}}\n\n'.encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def addr():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()


def test_exchange_times_events_and_reads_errors(addr):
    body = b"{}"
    ans = f.exchange(addr, f.post("/v1/completions", body), body)
    assert ans.status == 200 and ans.closed and len(ans.events) == 3
    assert 0 < ans.head_s <= ans.events[0] < ans.events[-1] <= ans.done_s
    first = f.exchange(addr, f.post("/v1/completions", body), body, max_events=1)
    assert len(first.events) == 1 and not first.closed
    bad = f.exchange(addr, f.post("/bad", body), body)
    assert (bad.key(), bad.reason()) == ("400", "too big")


def test_exchange_gives_up_at_the_deadline():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        ans = f.exchange(silent.getsockname(), f.get("/health"), limit_s=0.3)
    assert ans.status is None and ans.key() == "no answer within 0.3 s"


def test_loads_build_and_giants_fit_the_body_limit():
    z = f.Sizes(**f.QUICK)
    for name in f.LOADS:
        assert f.BUILDERS[name]("m", z)
    z = f.Sizes(messages=10**5, response_items=10**5, tools=10**4)
    limit = int(z.body_limit_mb * (1 << 20))
    for group in f.load_giants("m", z):
        head, body = group.make(0, 0)
        assert len(body) < limit and head.startswith(b"POST ")
    schemas = f.load_schemas("m", f.Sizes(schema_enum=10))[0]
    assert schemas.make(0, 0)[1] != schemas.make(1, 0)[1] != schemas.make(0, 1)[1]


def test_summarize_counts_failures_as_infinite():
    ok = [(0.01 * k, "200") for k in range(1, 100)]
    assert f.summarize(ok)["p99_ms"] == 990.0
    got = f.summarize([*ok[:98], (None, "429"), (None, "429")])
    assert got["p50_ms"] == 500.0 and got["p99_ms"] is None and got["failed"] == 2


def test_sizes_from_flags_then_quick_then_defaults():
    given = {field.name: None for field in f.dataclasses.fields(f.Sizes)}
    args = argparse.Namespace(quick=True, **given | {"streams": 3})
    z = f.sizes_from(args)
    assert (z.streams, z.silent, z.digits) == (3, f.QUICK["silent"], f.Sizes().digits)
