"""``bench.fairness``'s hostile loads: their sizes (``Sizes``; ``--quick``'s), the clients that
send them (``Requests``: a body again and again; ``Hold``: connections held open, silent or
trickling) and the process that runs one load until told to stop."""

from __future__ import annotations

import dataclasses
import json
import random
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from bench.rawhttp import ABANDONED, DEADLINE_S, _status, dumps, exchange, post
from bench.timing import nearest_rank as percentile

ROUND_S = 1.0
"""A load's client sends again at most this often."""
LOAD_SOURCE = ("127.0.0.2", 0)
"""The loads' source address: another client than the probes' (127.0.0.1) to the server, as
a hostile client is in the field (per-client fair scheduling, ``core.fair_queue``)."""
LOADS = ("schemas", "nested", "streams", "echo", "prompts", "connections", "giants", "deep")


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
    window_s=5.0,
    schema_requests=2,
    schema_enum=2000,
    streams=32,
    stream_tokens=16,
    echo_prompt_tokens=200,
    echo_n=4,
    many_prompts=100,
    max_prompts=16,
    header_mb=1.0,
    silent=20,
    slowloris=20,
    chat_mb=0.2,
    messages=2000,
    tools=200,
    response_items=2000,
    tokenize_mb=0.2,
)


def small_body(model: str, tokens: int = 1) -> bytes:
    body = {"model": model, "prompt": "the replicas boot and then they", "max_tokens": tokens}
    body |= {"temperature": 0.0, "stream": True, "ignore_eos": True}
    return json.dumps(body).encode()


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
