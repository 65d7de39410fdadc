"""HTTP limits (issue 23): what one client may hold of the server, over loopback, against the
HTTP layer ``warmboot serve`` uses (``http_config``) with short timeouts. Each attack runs next
to a small request (``GET /health``) whose latency must stay near a quiet baseline measured in
the same test: a huge header (431, at O(limit) cost), silent and slowloris connections (closed
by the header timeout, their descriptors released), a stalled body (408), more connections
than the cap (the longest idle go), bodies the JSON parser refuses and bodies over the limit
on any method (400 and 413 in the API's error shape). The same limits hold under h11.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import statistics
import sys
import threading
import time

import httpx
import pytest

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.config import HttpLimits
from warmboot.server.engine_holder import EngineHolder

LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_timeout_s=1.0)
SLACK_S = 1.0
"""Added to 10x the quiet baseline: the bound on a small request's latency under attack."""
DEEP = 100_000


@pytest.fixture(scope="module")
def url(path):
    llm = tiny_llm(path)
    with running_server(EngineHolder.ready(llm.engine), http_limits=LIMITS) as base:
        yield base


def _connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)


def _latency(url: str) -> float:
    t0 = time.perf_counter()
    resp = httpx.get(url + "/health", timeout=60)
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t0


def _assert_near(latencies: list[float], base: float) -> None:
    assert max(latencies) < 10 * base + SLACK_S, (latencies, base)


def _during(url: str, attack, rounds: int = 5) -> list:
    """Run ``attack()`` over and over in a thread while timing ``rounds`` small requests;
    assert they stay near a quiet baseline. Returns what the attacks returned."""
    base = statistics.median(_latency(url) for _ in range(5))
    stop, results = threading.Event(), []

    def loop():
        while not stop.is_set():
            results.append(attack())

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        latencies = [_latency(url) for _ in range(rounds)]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and results
    _assert_near(latencies, base)
    return results


def _reply(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset ends it too)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except OSError:
        pass
    return b"".join(chunks)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the request head


def _huge_header(url: str, size: int) -> tuple[int, float, bytes]:
    """Send a header of ``size`` bytes in 64 KiB pieces until the server stops it: (bytes
    sent, seconds, the reply)."""
    sock, sent, t0 = _connect(url), 0, time.perf_counter()
    with sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while sent < size:
                sent += sock.send(b"a" * 65536)
            sock.sendall(b"\r\n\r\n")
        except OSError:
            pass
        return sent, time.perf_counter() - t0, _reply(sock)


def test_a_64_mb_header_is_stopped_at_the_limit_and_stalls_nobody(url):
    results = _during(url, lambda: _huge_header(url, 64 << 20))
    for sent, seconds, reply in results:
        assert sent < 16 << 20 and seconds < 5, (sent, seconds)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431 "), reply[:100]


def test_a_header_over_the_limit_is_431_in_openai_shape(url):
    sent, _, reply = _huge_header(url, 70_000)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), reply[:200]
    assert b"connection: close" in head.lower()
    assert b'"type":"invalid_request_error"' in body and b"65536 bytes" in body
    with _connect(url) as sock:  # NOTE: a head just under the limit is fine
        filler = b"a" * (LIMITS.max_header_bytes - 200)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Fill: " + filler + b"\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")


def test_silent_and_slowloris_connections_are_closed_by_the_header_timeout(url):
    base = statistics.median(_latency(url) for _ in range(5))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = max(10, min(200, (soft - _fds() - 200) // 4))  # NOTE: 4 fds a pair of attackers
    fds0 = _fds()
    silent = [_connect(url) for _ in range(n)]
    slow = [_connect(url) for _ in range(n)]
    for sock in slow:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    replies, latencies = _hold(url, silent, slow)
    try:
        assert len(replies) == 2 * n, f"{2 * n - len(replies)} connections still open"
        assert _fds() <= fds0 + 2 * n + 10  # NOTE: the server's side of each is released
        assert all(replies[s] == b"" for s in silent)
        assert all(replies[s].startswith(b"HTTP/1.1 408 ") for s in slow)
    finally:
        for sock in silent + slow:
            sock.close()
    assert _fds() <= fds0 + 10
    _assert_near(latencies, base)


def _hold(url: str, silent: list, slow: list) -> tuple[dict, list[float]]:
    """Trickle a byte a round into each slowloris connection and time a small request,
    until the server has closed every connection (or a bound passes): (socket -> what it
    sent before closing, latencies)."""
    selector, replies, latencies = selectors.DefaultSelector(), {}, []
    for sock in silent + slow:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + LIMITS.header_timeout_s + 10
    while len(replies) < len(silent) + len(slow) and time.monotonic() < deadline:
        for sock in slow:
            if sock not in replies:
                try:
                    sock.send(b"X")
                except OSError:
                    pass
        latencies.append(_latency(url))
        for key, _ in selector.select(timeout=0.2):
            sock = key.fileobj
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                replies[sock] = replies.get(sock, b"") + chunk
            else:
                replies[sock] = replies.get(sock, b"")
                selector.unregister(sock)
    selector.close()
    return replies, latencies


def test_an_idle_keep_alive_connection_is_closed(url):
    with _connect(url) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _reply(sock).startswith(b"HTTP/1.1 200 ")  # NOTE: then the server closes
        seconds = time.perf_counter() - t0
    assert LIMITS.keep_alive_timeout_s * 0.8 < seconds < LIMITS.keep_alive_timeout_s + 3


# -- the request body


def _stalled_body(url: str) -> tuple[float, bytes]:
    with _connect(url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.perf_counter()
        reply = _reply(sock)
        return time.perf_counter() - t0, reply


def test_a_stalled_body_is_408_and_stalls_nobody(url):
    results = _during(url, lambda: _stalled_body(url), rounds=3)
    for seconds, reply in results:
        assert LIMITS.body_timeout_s * 0.8 < seconds < LIMITS.body_timeout_s + 5
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b'"invalid_request_error"' in body


def _big_bodies(url: str) -> list[httpx.Response]:
    over = b"x" * (4 << 20) + b"x"

    def chunked():
        for _ in range(5):
            yield b"x" * (1 << 20)

    with httpx.Client(timeout=60) as client:
        return [
            client.request("GET", url + "/health", content=over),
            client.request("GET", url + "/v1/models", content=chunked()),
            client.request("DELETE", url + "/v1/models", content=over),
            client.request("PATCH", url + "/v1/completions", content=chunked()),
        ]


def test_a_body_over_the_limit_is_413_on_every_method(url):
    for responses in _during(url, lambda: _big_bodies(url), rounds=3):
        for resp in responses:
            assert resp.status_code == 413, (resp.request.method, resp.text)
            assert "exceeds the limit" in resp.json()["error"]["message"]


def test_a_declared_length_over_the_limit_is_413_at_once(url):
    with _connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
        head, _, body = _reply(sock).partition(b"\r\n\r\n")  # NOTE: no body sent, no wait
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()


REFUSED = {
    "deep with an escape": (b"[" * DEEP + b'"\\ud800"' + b"]" * DEEP, "nested too deeply"),
    "deep": (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
    "long integer": (
        b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL_NAME.encode(), b"7" * 5000),
        "longer than 4300 digits",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_json_the_parser_refuses_is_400_in_the_api_shape(url, case):
    body, words = REFUSED[case]

    def post() -> list[httpx.Response]:
        with httpx.Client(timeout=60) as client:
            return [client.post(url + r, content=body) for r in ("/v1/completions", "/v1/messages")]

    for openai_resp, anthropic_resp in _during(url, post, rounds=3):
        assert openai_resp.status_code == 400, openai_resp.text
        error = openai_resp.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert anthropic_resp.status_code == 400, anthropic_resp.text
        assert anthropic_resp.json()["type"] == "error"
        assert words in anthropic_resp.json()["error"]["message"]


# -- the connection cap


def test_over_the_connection_cap_the_longest_idle_connections_go(path):
    limits = HttpLimits(max_connections=32, header_timeout_s=60)
    with running_server(EngineHolder.ready(tiny_llm(path).engine), http_limits=limits) as url:
        base = statistics.median(_latency(url) for _ in range(5))
        fds0 = _fds()
        socks = [_connect(url) for _ in range(100)]
        try:
            latencies = [_latency(url) for _ in range(3)]
            closed = _closed_within(socks, 5.0)
            assert len(closed) >= 100 - limits.max_connections, len(closed)
            assert socks[0] in closed  # NOTE: the oldest went first
            assert _fds() <= fds0 + 100 + limits.max_connections + 10
        finally:
            for sock in socks:
                sock.close()
        _assert_near(latencies, base)


def _closed_within(socks: list, seconds: float) -> set:
    """The sockets the server closes within ``seconds`` (waiting while more close)."""
    closed: set = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = len(closed)
        for sock in socks:
            if sock not in closed and _is_closed(sock):
                closed.add(sock)
        if closed and len(closed) == before:
            break
        time.sleep(0.2)
    return closed


def _is_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- h11 (uvicorn without httptools)


def test_the_limits_hold_under_h11(path, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn.protocols.http.httptools_impl", None)
    with running_server(EngineHolder.ready(tiny_llm(path).engine), http_limits=LIMITS) as url:
        base = statistics.median(_latency(url) for _ in range(3))
        _, _, reply = _huge_header(url, 70_000)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:100]
        seconds, reply = _stalled_body(url)
        assert reply.startswith(b"HTTP/1.1 408 ") and seconds < LIMITS.body_timeout_s + 5
        silent = _connect(url)
        replies, latencies = _hold(url, [silent], [])
        assert replies == {silent: b""}
        silent.close()
        resp = httpx.post(url + "/v1/completions", content=REFUSED["deep"][0], timeout=60)
        assert resp.status_code == 400 and "nested" in resp.json()["error"]["message"]
        _assert_near(latencies, base)
