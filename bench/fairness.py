"""Issue 23's fairness figures: p50 / p99 time to first token (TTFT) of a stream of small
requests, quiet and beside each hostile load, for warmboot and for vLLM's CPU build on the
same model (the soak, warmboot's memory under a long mixed load, is ``bench/soak.py``).

Each engine runs as its own server process (bf16, same ``max_model_len``) at its defaults
(warmboot probed once its compiled steps serve; ``--eager``: both ``--enforce-eager``, as the
issue's first figures were), one engine at a time. Per load: a load process (so its client
work never holds the probe's GIL) keeps the load's hostile traffic in flight, each request
sent again once answered (a round at most every ``ROUND_S``) and abandoned after
``DEADLINE_S`` (20 s for the schema clients, who leave); one second after it starts, this
process sends a streamed 1-token completion and a ``GET /health`` every ``--interval-s`` for
``--window-s`` (each on a new connection, abandoned after 60 s) and takes nearest-rank p50 /
p99 (a probe that fails or gets no token counts as infinite). Then the load is stopped and
what it got recorded (status codes, seconds to the answer or the refusal, connections the
server closed); a server that died or stopped answering is restarted (recorded). The goal,
per engine: under every load, p99 <= 2 x the quiet p99 plus one decode step (the inter-token
time of a quiet 16-token stream). The loads come from 127.0.0.2, the probes from 127.0.0.1:
two clients, as a hostile client and the others are.

The loads (sizes are flags, ``--quick`` shrinks them): ``schemas`` (N chats, each with a large
distinct ``enum`` json_schema), ``nested`` (one schema of 400 nested objects), ``streams``
(256 concurrent streams), ``echo`` (echo + logprobs + prompt_logprobs + n over a 1000-token
prompt), ``prompts`` (one request with 1000 prompts, one with 256), ``connections`` (a 64 MB
header, 500 silent connections, 600 slowloris connections at 1 byte/s), ``giants`` (a 3.9 MB
chat message, 10^5 messages, 10^4 tools, /v1/responses with 10^5 items, /tokenize of 3.9 MB:
each shrunk to fit the 4 MB body limit), ``deep`` (100k-deep JSON holding a ``\\u`` escape, a
5000-digit integer).

Run from the repository root (a full run: about 15 min for the loads of both engines)::

    python -m bench.fairness [--engines warmboot,vllm] [--loads schemas,streams,...]
                             [--warmboot-args '--max-step-ms 100'] [--quick]

Writes ``docs/benchmarks/fairness.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue
import random
import re
import resource
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
DEADLINE_S = 60.0
"""A probe or a load request with no (complete) answer by then is abandoned."""
ROUND_S = 1.0
"""A load's client sends again at most this often."""
LEAD_IN_S = 1.0
"""From the load's start to the first probe."""
SETTLE_S = 30.0
"""At most this long waiting, before a load, for the server to answer quietly again."""
STEP_TOKENS = 16
ABANDONED = "abandoned at the stop"
LOAD_SOURCE = ("127.0.0.2", 0)
"""The loads' source address: another client than the probes' (127.0.0.1) to the server, as
a hostile client is in the field (per-client fair scheduling, ``core.fair_queue``)."""
LOADS = ("schemas", "nested", "streams", "echo", "prompts", "connections", "giants", "deep")
ENGINES = ("warmboot", "vllm")
COLORS = {"warmboot": "tab:blue", "vllm": "tab:gray"}


@dataclasses.dataclass
class Sizes:
    window_s: float = 15.0
    interval_s: float = 0.25
    schema_requests: int = 4
    schema_enum: int = 60_000
    schema_leave_s: float = 20.0
    nested_depth: int = 400
    streams: int = 256
    stream_tokens: int = 64
    echo_prompt_tokens: int = 1000
    echo_n: int = 16
    echo_logprobs: int = 5
    """OpenAI's (and warmboot's) most for completions; vLLM allows 20."""
    echo_prompt_logprobs: int = 20
    many_prompts: int = 1000
    max_prompts: int = 256
    header_mb: float = 64.0
    silent: int = 500
    slowloris: int = 600
    chat_mb: float = 3.9
    messages: int = 100_000
    tools: int = 10_000
    response_items: int = 100_000
    tokenize_mb: float = 3.9
    deep_nesting: int = 100_000
    digits: int = 5000
    body_limit_mb: float = 4.0


QUICK = dict(
    window_s=5.0, schema_requests=2, schema_enum=2000, streams=32, stream_tokens=16,
    echo_prompt_tokens=200, echo_n=4, many_prompts=100, max_prompts=16, header_mb=1.0,
    silent=20, slowloris=20, chat_mb=0.2, messages=2000, tools=200, response_items=2000,
    tokenize_mb=0.2,
)  # fmt: skip


# --- raw HTTP/1.1 over loopback ------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    status: int | None = None
    head_s: float | None = None
    """Seconds from the connect to the status line."""
    events: list[float] = dataclasses.field(default_factory=list)
    """Seconds from the connect to each server-sent ``data: {`` event."""
    closed: bool = False
    """The server ended the response (every request says ``Connection: close``)."""
    error: str | None = None
    done_s: float = 0.0
    """Seconds from the connect to the end: the close, an error, the deadline."""
    raw: bytes = b""
    """The answer's first 2 KB."""

    def reason(self) -> str:
        """An error answer's message (OpenAI's ``message`` or FastAPI's ``detail``), short."""
        body = self.raw.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")
        found = re.search(r'"(?:message|msg|detail)"\s*:\s*"((?:[^"\\]|\\.){0,200})', body)
        return (found.group(1) if found else body[:120]).strip()

    def key(self) -> str:
        if self.status is None:
            return self.error or "no status"
        if self.error in (None, ABANDONED):
            return str(self.status)
        return f"{self.status}, then {self.error}"


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()


def exchange(
    addr: tuple[str, int],
    head: bytes,
    body: bytes = b"",
    limit_s: float = DEADLINE_S,
    cancel: Callable[[], bool] | None = None,
    max_events: int = 0,
    source: tuple[str, int] | None = None,
) -> Answer:
    """Send one request on a new connection (from ``source``) and read its answer until the
    server closes it, ``max_events`` SSE events came, ``cancel()`` says so, or ``limit_s``
    passed."""
    t0 = time.perf_counter()
    ans = Answer()
    try:
        sock = socket.create_connection(addr, timeout=limit_s, source_address=source)
    except OSError as e:
        ans.error = f"connect: {type(e).__name__}"
        return ans
    with sock:
        try:
            sock.settimeout(limit_s)  # NOTE: the total for each sendall
            sock.sendall(head)
            if body:
                sock.sendall(body)
        except OSError as e:
            ans.error = f"send: {type(e).__name__}"
        _receive(sock, t0, limit_s, ans, cancel, max_events)
    ans.done_s = time.perf_counter() - t0
    return ans


def _receive(sock, t0: float, limit_s: float, ans: Answer, cancel, max_events: int) -> None:
    first, tail, pattern = b"", b"", b"data: {"
    while True:
        left = t0 + limit_s - time.perf_counter()
        if left <= 0:
            what = "no answer" if ans.status is None else "unfinished"
            ans.error = f"{what} within {limit_s:g} s"
            return
        if cancel is not None and cancel():
            ans.error = ABANDONED
            return
        sock.settimeout(min(0.5, left))
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        except OSError as e:
            ans.error = (
                ans.error if ans.status is None and ans.error else f"recv: {type(e).__name__}"
            )
            return
        now = time.perf_counter() - t0
        if not data:
            ans.closed = True
            return
        if len(ans.raw) < 2048:
            ans.raw += data[: 2048 - len(ans.raw)]
        if ans.status is None:
            first += data
            if b"\r\n" not in first:
                continue
            ans.status, ans.head_s, ans.error = _status(first), now, None
            data = first.split(b"\r\n\r\n", 1)[-1]
        ans.events += [now] * (tail + data).count(pattern)
        tail = data[-(len(pattern) - 1) :]
        if max_events and len(ans.events) >= max_events:
            return


def _status(first: bytes) -> int:
    parts = first.split(b"\r\n", 1)[0].split()
    if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return -1


# --- the small requests --------------------------------------------------------------------


def small_body(model: str, tokens: int = 1) -> bytes:
    body = {"model": model, "prompt": "the replicas boot and then they", "max_tokens": tokens}
    body |= {"temperature": 0.0, "stream": True, "ignore_eos": True}
    return json.dumps(body).encode()


def ttft(addr, model: str) -> tuple[float | None, str]:
    """(seconds to the first streamed token or None, the outcome) of one 1-token completion."""
    body = small_body(model)
    ans = exchange(addr, post("/v1/completions", body), body, max_events=1)
    ok = ans.status == 200 and ans.events
    return (ans.events[0] if ok else None), ans.key()


def health(addr) -> tuple[float | None, str]:
    ans = exchange(addr, get("/health"))
    return (ans.head_s if ans.status == 200 else None), ans.key()


def compiled_steps(addr) -> bool:
    """Whether warmboot's compiled model steps serve (its default compiles after the start)."""
    url = f"http://{addr[0]}:{addr[1]}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return b"\nwarmboot_compiled_steps 1.0" in r.read()
    except OSError:
        return False


def decode_step(addr, model: str, repeats: int = 3) -> float | None:
    """Seconds per decode step: the median inter-token time of quiet 16-token streams."""
    body = small_body(model, STEP_TOKENS)
    steps = []
    for _ in range(repeats):
        ans = exchange(addr, post("/v1/completions", body), body)
        if ans.status == 200 and len(ans.events) >= 2:
            steps.append((ans.events[-1] - ans.events[0]) / (STEP_TOKENS - 1))
    return sorted(steps)[len(steps) // 2] if steps else None


def probe_stream(addr, model: str, window_s: float, interval_s: float) -> dict:
    """A 1-token completion and a ``/health`` every ``interval_s`` for ``window_s``, each
    in its own thread; returns their summaries."""
    got: dict[str, list] = {"ttft": [], "health": []}
    threads = []

    def one(kind: str, tick: int, fn) -> None:
        got[kind].append((tick, fn()))

    t0 = time.perf_counter()
    for tick in range(max(1, int(window_s / interval_s))):
        time.sleep(max(0.0, t0 + tick * interval_s - time.perf_counter()))
        for kind, fn in (("ttft", lambda: ttft(addr, model)), ("health", lambda: health(addr))):
            threads.append(threading.Thread(target=one, args=(kind, tick, fn), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join(DEADLINE_S + 5)
    out = {kind: summarize([v for _, v in sorted(got[kind])]) for kind in got}
    return out | {"started_at": round(time.time() - (time.perf_counter() - t0), 3)}


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (p99 of fewer than 100 samples is their maximum)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def ms(v: float) -> float | None:
    return None if v is None or math.isinf(v) else round(v * 1e3, 2)


def summarize(samples: list[tuple[float | None, str]]) -> dict:
    """p50 / p99 ms (a failed sample counts as infinite: None), counts of the outcomes."""
    values = [math.inf if v is None else v for v, _ in samples] or [math.inf]
    return {
        "n": len(samples),
        "failed": sum(v is None for v, _ in samples),
        "p50_ms": ms(percentile(values, 50)),
        "p99_ms": ms(percentile(values, 99)),
        "outcomes": dict(Counter(k for _, k in samples)),
        "ms": [ms(v) for v, _ in samples],  # NOTE: in the order sent (failed: None)
    }


# --- the loads -----------------------------------------------------------------------------


class Requests:
    """``count`` clients, each sending ``make(client, round) -> (head, body)`` again and again
    until stopped, each request abandoned after ``limit_s``, and at the stop but for a
    client's first (so the first answer or refusal is always waited for)."""

    def __init__(self, label: str, count: int, make, limit_s=DEADLINE_S, stream=False):
        self.label, self.count, self.make, self.limit_s, self.stream = (
            label,
            count,
            make,
            limit_s,
            stream,
        )
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()
        self.reasons: dict[str, str] = {}
        """The first error message seen for each non-200 status."""
        self.answer_s: list[float] = []
        """Seconds to the status line, or to the end (a reset, the deadline) without one."""

    def workers(self, addr, stop) -> list[Callable[[], None]]:
        return [lambda i=i: self._client(i, addr, stop) for i in range(self.count)]

    def _client(self, i: int, addr, stop) -> None:
        r = 0
        while not stop.is_set():
            t = time.monotonic()
            head, body = self.make(i, r)
            cancel = stop.is_set if self.stream or r else None  # NOTE: round 0 runs its course
            ans = exchange(addr, head, body, self.limit_s, cancel, source=LOAD_SOURCE)
            with self.lock:
                self.statuses[ans.key()] += 1
                if ans.status not in (None, 200):
                    self.reasons.setdefault(ans.key(), ans.reason())
                if ans.head_s is not None or ans.error != ABANDONED:
                    self.answer_s.append(ans.head_s if ans.head_s is not None else ans.done_s)
            r += 1
            stop.wait(max(0.0, ROUND_S - (time.monotonic() - t)))

    def outcome(self) -> dict:
        with self.lock:
            out = {"label": self.label, "clients": self.count, "statuses": dict(self.statuses)}
            out["reasons"] = dict(self.reasons)
            out["sent"] = sum(self.statuses.values())
            if self.answer_s:
                out["answer_s_p50"] = round(percentile(self.answer_s, 50), 3)
                out["answer_s_max"] = round(max(self.answer_s), 3)
        return out


class Hold:
    """``count`` connections held open, silent or sending ``trickle`` at 1 byte/s each; records
    which the server closes (and when) and any status it sends first."""

    def __init__(self, label: str, count: int, trickle: bytes | None = None):
        self.label, self.count, self.trickle = label, count, trickle
        self.statuses: Counter = Counter()
        self.closed_s: list[float] = []
        self.opened = self.still_open = 0

    def workers(self, addr, stop) -> list[Callable[[], None]]:
        return [lambda: self._run(addr, stop)]

    def _run(self, addr, stop) -> None:
        t0 = time.perf_counter()
        sel = selectors.DefaultSelector()
        for s in self._open(addr):
            sel.register(s, selectors.EVENT_READ, 0)
        next_byte = t0
        while not stop.is_set() and sel.get_map():
            for key, _ in sel.select(timeout=0.2):
                self._readable(sel, key.fileobj, t0)
            if self.trickle and time.perf_counter() >= next_byte:
                next_byte += 1.0
                self._trickle(sel, t0)
        self.still_open = len(sel.get_map())
        for key in list(sel.get_map().values()):
            key.fileobj.close()

    def _open(self, addr) -> list[socket.socket]:
        socks = []
        for _ in range(self.count):
            try:
                s = socket.create_connection(addr, timeout=5, source_address=LOAD_SOURCE)
            except OSError as e:
                self.statuses[f"connect: {type(e).__name__}"] += 1
                continue
            s.setblocking(False)
            socks.append(s)
        self.opened = len(socks)
        return socks

    def _readable(self, sel, sock, t0: float) -> None:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data and data.startswith(b"HTTP/"):
            self.statuses[str(_status(data))] += 1
        if not data:
            self._close(sel, sock, t0)

    def _trickle(self, sel, t0: float) -> None:
        for key in list(sel.get_map().values()):
            sent = key.data
            byte = self.trickle[sent : sent + 1] or b"a"
            try:
                key.fileobj.send(byte)
                sel.modify(key.fileobj, selectors.EVENT_READ, sent + 1)
            except OSError:
                self._close(sel, key.fileobj, t0)

    def _close(self, sel, sock, t0: float) -> None:
        self.closed_s.append(time.perf_counter() - t0)
        sel.unregister(sock)
        sock.close()

    def outcome(self) -> dict:
        out = {"label": self.label, "clients": self.count, "opened": self.opened}
        out |= {"closed_by_server": len(self.closed_s), "still_open_at_stop": self.still_open}
        out["statuses"] = dict(self.statuses)
        if self.closed_s:
            out["closed_s_p50"] = round(percentile(self.closed_s, 50), 2)
        return out


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def once(label: str, path: str, body: bytes, limit_s: float = DEADLINE_S) -> Requests:
    """One client sending the same body."""
    return Requests(label, 1, lambda i, r: (post(path, body), body), limit_s)


def salted(label: str, template: bytes, count: int, limit_s: float) -> Requests:
    """``count`` clients whose bodies are ``template`` with ``@S@`` made distinct per request."""

    def make(i: int, r: int) -> tuple[bytes, bytes]:
        body = template.replace(b"@S@", f"{i}.{r}.".encode())
        return post("/v1/chat/completions", body), body

    return Requests(label, count, make, limit_s)


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "pick one"}]} | extra


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def load_schemas(model: str, z: Sizes) -> list:
    enum = [f"@S@{k}" for k in range(z.schema_enum)]
    body = chat(model, max_tokens=8, response_format=json_schema({"type": "string", "enum": enum}))
    label = f"{z.schema_requests} x {z.schema_enum}-string enum, leave at {z.schema_leave_s:g} s"
    return [salted(label, dumps(body), z.schema_requests, z.schema_leave_s)]


def load_nested(model: str, z: Sizes) -> list:
    schema: dict = {"type": "string"}
    for _ in range(z.nested_depth):
        schema = {"type": "object", "properties": {"a": schema}}
    schema["description"] = "@S@"
    body = dumps(chat(model, max_tokens=8, response_format=json_schema(schema)))
    return [salted(f"{z.nested_depth} nested objects ({len(body) >> 10} KB)", body, 1, DEADLINE_S)]


def load_streams(model: str, z: Sizes) -> list:
    body = small_body(model, z.stream_tokens)
    make = lambda i, r: (post("/v1/completions", body), body)  # noqa: E731
    label = f"{z.streams} streams of {z.stream_tokens} tokens"
    return [Requests(label, z.streams, make, stream=True)]


def load_echo(model: str, z: Sizes) -> list:
    rng = random.Random(0)
    ids = [rng.randrange(100, 40_000) for _ in range(z.echo_prompt_tokens)]
    body = {"model": model, "prompt": ids, "max_tokens": 16, "echo": True, "n": z.echo_n}
    body |= {"logprobs": z.echo_logprobs, "prompt_logprobs": z.echo_prompt_logprobs}
    label = f"echo + logprobs {z.echo_logprobs} + prompt_logprobs {z.echo_prompt_logprobs}"
    label += f" + n {z.echo_n}, {z.echo_prompt_tokens}-token prompt"
    return [once(label, "/v1/completions", dumps(body))]


def load_prompts(model: str, z: Sizes) -> list:
    def body(n: int) -> bytes:
        prompts = [f"prompt number {k} says" for k in range(n)]
        return dumps({"model": model, "prompt": prompts, "max_tokens": 16, "ignore_eos": True})

    return [
        once(f"{n} prompts", "/v1/completions", body(n)) for n in (z.many_prompts, z.max_prompts)
    ]


def load_connections(model: str, z: Sizes) -> list:
    size = int(z.header_mb * (1 << 20))
    head = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
        + b"a" * size
        + b"\r\nConnection: close\r\n\r\n"
    )
    slow = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
    return [
        Requests(f"{z.header_mb:g} MB header", 1, lambda i, r: (head, b"")),
        Hold(f"{z.silent} silent connections", z.silent),
        Hold(f"{z.slowloris} slowloris connections at 1 byte/s", z.slowloris, slow),
    ]


def fit(count: int, item: dict, z: Sizes) -> int:
    """``count`` items, or as many as fit (with 4 KB to spare) under the body limit."""
    return min(count, (int(z.body_limit_mb * (1 << 20)) - 4096) // (len(dumps(item)) + 1))


def load_giants(model: str, z: Sizes) -> list:
    msg = {"role": "user", "content": "hi"}
    item = {"type": "message", "role": "user", "content": "hi"}
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    n_msg, n_tools, n_items = (
        fit(z.messages, msg, z),
        fit(z.tools, tool, z),
        fit(z.response_items, item, z),
    )
    tools = [tool | {"function": tool["function"] | {"name": f"f{k}"}} for k in range(n_tools)]
    words = "word " * int(z.chat_mb * 1e6 / 5)
    text = "word " * int(z.tokenize_mb * 1e6 / 5)
    return [
        once(
            f"{z.chat_mb:g} MB chat message",
            "/v1/chat/completions",
            dumps(chat(model, max_tokens=1, messages=[msg | {"content": words}])),
        ),
        once(
            f"{n_msg} messages",
            "/v1/chat/completions",
            dumps(chat(model, max_tokens=1, messages=[msg] * n_msg)),
        ),
        once(
            f"{n_tools} tools",
            "/v1/chat/completions",
            dumps(chat(model, max_tokens=1, tools=tools)),
        ),
        once(
            f"/v1/responses, {n_items} items",
            "/v1/responses",
            dumps(
                {"model": model, "input": [item] * n_items, "max_output_tokens": 1, "store": False}
            ),
        ),
        once(
            f"/tokenize {z.tokenize_mb:g} MB", "/tokenize", dumps({"model": model, "prompt": text})
        ),
    ]


def load_deep(model: str, z: Sizes) -> list:
    start = f'{{"model":"{model}","prompt":"x","max_tokens":1,"user":'.encode()
    deep = start + b"[" * z.deep_nesting + b'"\\u00e9"' + b"]" * z.deep_nesting + b"}"
    digits = f'{{"model":"{model}","prompt":"x","max_tokens":'.encode() + b"9" * z.digits + b"}"
    return [
        once(f"{z.deep_nesting}-deep JSON with a \\u escape", "/v1/completions", deep),
        once(f"{z.digits}-digit integer", "/v1/completions", digits),
    ]


BUILDERS = {name: globals()[f"load_{name}"] for name in LOADS}


def load_main(name: str, addr, model: str, z: Sizes, ready, stop, out) -> None:
    """The load process: build the load, run it until ``stop``, put its outcomes on ``out``."""
    raise_fd_limit()
    groups = BUILDERS[name](model, z)
    threads = [
        threading.Thread(target=w, daemon=True) for g in groups for w in g.workers(addr, stop)
    ]
    for t in threads:
        t.start()
    ready.set()
    stop.wait()
    end = time.monotonic() + DEADLINE_S + 5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    out.put([g.outcome() for g in groups])


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """A server process (own session); ``addr`` and ``model_id`` for requests."""

    name = model_id = ""

    def __init__(self, model: Path, args):
        self.model, self.args = model, args
        self.proc: subprocess.Popen | None = None
        self.addr = ("127.0.0.1", 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Warmboot(Engine):
    name, model_id = "warmboot", "bench"

    def start(self) -> None:
        self.addr = ("127.0.0.1", free_port())
        cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(self.model)]
        cmd += ["--port", str(self.addr[1]), "--served-model-name", self.model_id]
        cmd += ["--dtype", self.args.dtype, "--max-model-len", str(self.args.max_model_len)]
        eager = ["--enforce-eager"] if self.args.eager else []
        self.cmd = [*cmd, *eager, *shlex.split(self.args.warmboot_args)]
        log = open(f"/tmp/bench-{self.model_id}-warmboot-{self.addr[1]}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + 600
        while health(self.addr)[0] is None:
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"warmboot did not become healthy; see {log.name}")
            time.sleep(0.2)
        while not self.args.eager and not compiled_steps(self.addr):
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"warmboot's compiled steps did not serve; see {log.name}")
            time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever is left of it."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        self.proc.wait()


class Vllm(Engine):
    name = "vllm"

    def start(self) -> None:
        from bench.peers import vllm_cpu

        self.model_id = vllm_cpu._SERVED_NAME
        self.addr = ("127.0.0.1", free_port())
        kw = {"dtype": self.args.dtype, "max_model_len": self.args.max_model_len}
        self.proc = vllm_cpu.start_server(
            self.model, self.addr[1], enforce_eager=self.args.eager, timeout_s=900, **kw
        )

    def stop(self) -> None:
        from bench.peers import vllm_cpu

        vllm_cpu.stop_server(self.proc)


def answering(engine: Engine, limit_s: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and engine.alive():
        if ttft(engine.addr, engine.model_id)[0] is not None:
            return True
        time.sleep(1.0)
    return False


def recover(engine: Engine) -> str | None:
    """Restart the server if it died or does not answer a small request within 60 s;
    returns why it was restarted, or None."""
    if answering(engine):
        return None
    why = "stopped answering" if engine.alive() else f"died (rc {engine.proc.returncode})"
    engine.stop()
    engine.start()
    return why


def settle(engine: Engine, bound_s: float) -> float:
    """Seconds until a small request's TTFT is back under ``bound_s`` (at most SETTLE_S)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        got = ttft(engine.addr, engine.model_id)[0]
        if got is not None and got <= bound_s:
            break
        time.sleep(0.5)
    return round(time.monotonic() - t0, 2)


# --- a run per engine ----------------------------------------------------------------------


def quiet_run(engine: Engine, z: Sizes) -> dict:
    for _ in range(3):  # NOTE: warm-up (first-request allocations)
        ttft(engine.addr, engine.model_id)
    step = decode_step(engine.addr, engine.model_id)
    probes = probe_stream(engine.addr, engine.model_id, z.window_s, z.interval_s)
    row = {"engine": engine.name, "load": "quiet", "decode_step_ms": ms(step)} | probes
    p99 = probes["ttft"]["p99_ms"]
    row["goal_ms"] = None if p99 is None or step is None else round(2 * p99 + step * 1e3, 2)
    return row


def load_run(engine: Engine, name: str, z: Sizes, goal_ms: float | None) -> dict:
    settled = settle(engine, (goal_ms or 1e3) / 1e3)
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    args = (name, engine.addr, engine.model_id, z, ready, stop, out)
    child = ctx.Process(target=load_main, args=args, daemon=True)
    t0 = time.monotonic()
    child.start()
    while not ready.wait(0.5) and child.is_alive() and time.monotonic() - t0 < 120:
        pass  # NOTE: building the bodies (a 64 MB header, 4 MB giants) takes a moment
    time.sleep(LEAD_IN_S)
    probes = probe_stream(engine.addr, engine.model_id, z.window_s, z.interval_s)
    stop.set()
    outcome = collect(child, out)
    row = {"engine": engine.name, "load": name, "settle_s": settled} | probes
    row |= {"outcome": outcome, "load_s": round(time.monotonic() - t0, 1)}
    row["restarted"] = recover(engine)
    p99 = probes["ttft"]["p99_ms"]
    row["goal_ms"] = goal_ms
    row["met"] = None if goal_ms is None else (p99 is not None and p99 <= goal_ms)
    return row


def collect(child, out) -> list[dict]:
    try:
        got = out.get(timeout=DEADLINE_S + 30)
    except queue.Empty:
        child.kill()
        got = [{"label": "load process", "statuses": {f"stuck past {DEADLINE_S + 30:g} s": 1}}]
    child.join(10)
    if child.is_alive():
        child.kill()
    return got


def run_engine(engine: Engine, z: Sizes, loads: list[str]) -> list[dict]:
    t0 = time.monotonic()
    try:
        engine.start()
    except Exception as e:  # noqa: BLE001
        print(f"{engine.name}: did not start: {e}", flush=True)
        return [{"engine": engine.name, "load": "quiet", "error": f"did not start: {e}"[:2000]}]
    try:
        quiet = quiet_run(engine, z)
        quiet["start_s"] = round(time.monotonic() - t0, 1)
        report_row(quiet)
        rows = [quiet]
        for name in loads:
            try:
                rows.append(load_run(engine, name, z, quiet["goal_ms"]))
            except Exception as e:  # noqa: BLE001 (a restart that failed)
                rows.append({"engine": engine.name, "load": name, "error": repr(e)[:2000]})
            report_row(rows[-1])
            if not engine.alive():
                break
    finally:
        engine.stop()
    return rows


def report_row(row: dict) -> None:
    if "ttft" not in row:
        print(f"{row['engine']:>8} {row['load']:<12} {outcome_text(row)}", flush=True)
        return
    t, h = row["ttft"], row["health"]
    print(
        f"{row['engine']:>8} {row['load']:<12} ttft p50/p99 {t['p50_ms']}/{t['p99_ms']} ms"
        f" (failed {t['failed']}/{t['n']}), health p99 {h['p99_ms']} ms,"
        f" met {row.get('met', '-')}, {outcome_text(row)}",
        flush=True,
    )


def sizes_from(args) -> Sizes:
    """The flags given, else the ``--quick`` sizes, else the defaults."""
    z = Sizes(**(QUICK if args.quick else {}))
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)}
    return dataclasses.replace(z, **{k: v for k, v in given.items() if v is not None})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", default="warmboot,vllm", help="comma-separated: warmboot,vllm")
    ap.add_argument(
        "--loads", default=",".join(LOADS), help="comma-separated subset of " + ",".join(LOADS)
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes and windows: a smoke run")
    ap.add_argument("--model", type=Path, default=None, help="default: the demo model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="both engines --enforce-eager")
    ap.add_argument("--warmboot-args", default="",
                    help="more `warmboot serve` flags, e.g. '--max-step-ms 0'")  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=OUT)
    for f in dataclasses.fields(Sizes):
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=None,
            help=f"default {f.default} ({QUICK.get(f.name, f.default)} with --quick)",
        )
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    loads = [n for n in args.loads.split(",") if n]
    bad = sorted(set(engines) - set(ENGINES)) + sorted(set(loads) - set(LOADS))
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    z = sizes_from(args)
    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = Path(ensure_default_model())
    raise_fd_limit()
    made = {"warmboot": Warmboot, "vllm": Vllm}
    rows = [r for e in engines for r in run_engine(made[e](args.model, args), z, loads)]
    write_report(args, z, engines, loads, rows)


def outcome_text(row: dict) -> str:
    if "error" in row:
        return row["error"][:200]
    parts = []
    for o in row.get("outcome", []):
        st = ", ".join(f"{k} x{v}" for k, v in o.get("statuses", {}).items())
        extra = ""
        if "answer_s_p50" in o:
            extra = f", in {o['answer_s_p50']:g} s (max {o['answer_s_max']:g})"
        if "opened" in o:
            extra = f", opened {o['opened']}, server closed {o['closed_by_server']}"
            extra += f" (p50 {o['closed_s_p50']:g} s)" if "closed_s_p50" in o else ""
        parts.append(f"{o['label']}: {st or '-'}{extra}")
    if row.get("restarted"):
        parts.append(f"**restarted: {row['restarted']}**")
    if row.get("settle_s", 0) >= SETTLE_S:
        parts.append(f"(still slow from the load before after {SETTLE_S:g} s)")
    return "; ".join(parts) or "-"


def cell(s: dict) -> str:
    fmt = lambda v: "fail" if v is None else f"{v:.0f}"  # noqa: E731
    failed = f" ({s['failed']}/{s['n']} failed)" if s["failed"] else ""
    return f"{fmt(s['p50_ms'])} / {fmt(s['p99_ms'])}{failed}"


def met_text(row: dict | None) -> str:
    if row is None or row.get("met") is None:
        return "-"
    return "yes" if row["met"] else "**no**"


def write_report(args, z: Sizes, engines, loads, rows) -> None:
    from bench.common import pyplot, report_meta, save_report

    meta = report_meta(
        model=Path(args.model).name, dtype=args.dtype, max_model_len=args.max_model_len
    )
    meta |= {"sizes": dataclasses.asdict(z), "engines": engines, "quick": args.quick}
    if "vllm" in engines:
        from bench.peers import vllm_cpu

        meta["vllm"] = vllm_cpu.VLLM_VERSION
    by = {(r["engine"], r["load"]): r for r in rows}
    lines = report_lines(args, meta, z, engines, loads, by)
    plt = pyplot()
    fig = plot_fairness(plt, engines, ["quiet", *loads], by, meta)
    save_report(args.out, "fairness", meta, {"loads": rows}, lines, fig)


def report_lines(args, meta, z: Sizes, engines, loads, by) -> list[str]:
    cmd = " ".join(["python -m bench.fairness", *sys.argv[1:]])
    mode = "eager" if args.eager else "each engine at its defaults"
    lines = [
        "# Fairness: a small request's time to first token beside hostile loads",
        "",
        f"{meta['date']} · {meta['machine']} · model `{meta['model']}` ({args.dtype}, {mode},"
        f" max_model_len {args.max_model_len}) · vLLM CPU {meta.get('vllm', '-')} · `{cmd}`.",
        "",
        f"Probes: a streamed 1-token completion and a `GET /health` every {z.interval_s:g} s for"
        f" {z.window_s:g} s, each on a new connection, from 1 s after the load started;"
        " milliseconds, nearest-rank p50 / p99 (a probe with no token counts as infinite:"
        f" `fail`). Goal: p99 <= 2 x the quiet p99 + one decode step (a quiet {STEP_TOKENS}-token"
        " stream's inter-token time), per engine. Load outcome: status (or error) x count,"
        " seconds from the connect to the status line (or to the end without one).",
        "",
    ]
    for e in engines:
        q = by.get((e, "quiet"), {})
        if "ttft" in q:
            lines.append(
                f"- {e}: decode step {q['decode_step_ms']} ms, goal {q['goal_ms']} ms,"
                f" time to a healthy server {q['start_s']} s"
            )
        else:
            lines.append(f"- {e}: {q.get('error', 'not run')}")
    return lines + table_lines(loads, by) + ["", "![fairness](fairness.png)", ""] + reasons(by)


def table_lines(loads, by) -> list[str]:
    lines = [
        "",
        "| load | warmboot TTFT p50 / p99 | goal | met? | warmboot /health p50 / p99 |"
        " vLLM TTFT p50 / p99 | goal | met? | warmboot: load outcome | vLLM: load outcome |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    ok = lambda r: r is not None and "ttft" in r  # noqa: E731
    for load in ["quiet", *loads]:
        w, v = by.get(("warmboot", load)), by.get(("vllm", load))
        gw, gv = (by.get((e, "quiet"), {}).get("goal_ms") for e in ENGINES)
        lines.append(
            f"| {load} | {cell(w['ttft']) if ok(w) else '-'} | {num(gw)} | {met_text(w)} |"
            f" {cell(w['health']) if ok(w) else '-'} | {cell(v['ttft']) if ok(v) else '-'} |"
            f" {num(gv)} | {met_text(v)} | {outcome_text(w) if w else '-'} |"
            f" {outcome_text(v) if v else '-'} |"
        )
    return lines


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def reasons(by) -> list[str]:
    """The error messages the loads got, one line per (engine, load, status)."""
    lines = []
    for (engine, load), row in by.items():
        for o in row.get("outcome", []):
            for status, why in o.get("reasons", {}).items():
                why = why[:200].replace("`", "'")
                lines.append(f"- {engine}, {load}, {o['label']}: {status}: `{why}`")
    return ["Error messages (the first of each status):", "", *lines, ""] if lines else []


def plot_fairness(plt, engines, loads, by, meta):
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(engines))
    for j, e in enumerate(engines):
        xs, ys, hatch = [], [], []
        for i, load in enumerate(loads):
            r = by.get((e, load))
            if r is None or "ttft" not in r:
                continue
            p99 = r["ttft"]["p99_ms"]
            xs.append(i + (j - (len(engines) - 1) / 2) * width)
            ys.append(p99 if p99 is not None else DEADLINE_S * 1e3)
            hatch.append(p99 is None)
        bars = ax.bar(xs, ys, width, color=COLORS[e], label=f"{e} p99")
        for bar, h in zip(bars, hatch, strict=True):
            bar.set_hatch("//" if h else "")
        goal = by.get((e, "quiet"), {}).get("goal_ms")
        if goal:
            ax.axhline(goal, color=COLORS[e], linestyle="--", linewidth=1, label=f"{e} goal")
    ax.set_xticks(range(len(loads)), loads, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p99, ms (log; hatched: failed)")
    ax.set_title(
        f"small request beside hostile loads · {meta['machine']} · {meta['date']}", fontsize=9
    )
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
