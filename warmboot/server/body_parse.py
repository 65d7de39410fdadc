"""Large request bodies are screened in a child process before the event loop parses them.

Parsing and validating a body of megabytes (``json.loads``, then pydantic: 100000 chat
messages take about half a second) holds the GIL the whole time, so in the server's process
it stalls every other client, threads or not, even for a body refused a moment later as too
long for the context. So a POST body of at least ``MIN_SCREEN_BYTES`` to an API route goes
first to a child process of the server's own (``screen_child``, at a lower CPU priority),
which runs the same app on it with a stand-in for the engine that knows only the facts
requests are checked against before they reach it (context length, the tokenizer's longest
token and size, the chat template). If the app refuses the body there (a 4xx), the child's
answer, byte for byte, is the answer: this process never parses it. Otherwise (it would reach
the engine, or the child failed) the body goes through the app here as before.

At most ``WORKERS`` children screen at once; other large bodies wait their turn (off the event
loop), so a flood of them queues among itself, not in front of small requests; past
``MAX_WAITING`` of them a large body gets a 429 with ``Retry-After`` at once (a waiting body is
held in memory: up to the body limit each). Frames on the
children's pipes: an 8-byte big-endian length, then that many bytes (JSON, or the body).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from warmboot.server.config import ServerConfig

log = logging.getLogger("warmboot.server")
SCREENED = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
    }
)
"""The POST routes whose bodies are screened."""
MIN_SCREEN_BYTES = 128 << 10
"""Smaller bodies are parsed here (the worst case, many small items: about 15 ms)."""
WORKERS = 1
"""Children screening at once (each keeps a core busy while it does)."""
TIMEOUT_S = 60.0
"""A child that has not answered by then is killed; the body goes through the app here."""
REFUSALS = frozenset({400, 404, 422})
"""The statuses a child's answer may carry: the app's refusals of the request itself (not a
429 or 503: those depend on this process's state)."""
MAX_WAITING = 16
"""Large bodies that may wait for a child (16 x the 4 MB body limit at most)."""
CHUNK = 1 << 16
ROOT = Path(__file__).resolve().parents[2]


class Screen:
    """The children and the queue for them. ``refusal`` is the only call on the event loop."""

    def __init__(self, config: ServerConfig, workers: int = WORKERS):
        self._setup = json.dumps(dataclasses.asdict(config) | {"api_key": None}).encode()
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Child] = []
        self._closed = False
        self.waiting = 0
        """Bodies in ``refusal`` now (screened or waiting for a child)."""

    @staticmethod
    def wants(scope, body: bytes) -> bool:
        return (
            scope["method"] == "POST"
            and scope["path"] in SCREENED
            and len(body) >= MIN_SCREEN_BYTES
        )

    async def refusal(self, scope, facts: dict, body: bytes) -> tuple[int, bytes] | None:
        """(status, JSON body) of the app's refusal of the request, or None: it gets past the
        early checks (or the child failed) and goes through the app here."""
        header = json.dumps({"scope": _plain_scope(scope), "facts": facts}).encode()
        self.waiting += 1
        try:
            async with self._slots:
                verdict = await self._screen(header, body)
        finally:
            self.waiting -= 1
        if verdict is None or "status" not in verdict:
            return None
        return int(verdict["status"]), verdict["body"].encode()

    async def _screen(self, header: bytes, body: bytes) -> dict | None:
        child = self._idle.pop() if self._idle else None
        verdict, child = await asyncio.to_thread(self._ask, child, header, body)
        if child is not None:
            if self._closed:
                child.close()
            else:
                self._idle.append(child)
        return verdict

    def _ask(self, child: _Child | None, header: bytes, body: bytes):
        """(verdict or None, the child if it is still usable); runs on a worker thread."""
        try:
            child = child or _Child(self._setup)
            return child.ask(header, body), child
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            log.warning("a body screening child failed (%s); the body is parsed here", e)
            if child is not None:
                child.kill()
            return None, None

    def close(self) -> None:
        """Stop the idle children (one busy now stops when it is done)."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class _Child:
    """One ``screen_child`` process, fed by this process only (no untrusted pickles)."""

    def __init__(self, setup: bytes):
        path = os.environ.get("PYTHONPATH")
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "warmboot.server.screen_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        try:
            send_frames(self._in, [setup], time.monotonic() + TIMEOUT_S)
        except OSError:
            self.kill()
            raise

    def ask(self, header: bytes, body: bytes) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        send_frames(self._in, [header, body], deadline)
        return json.loads(read_frame(self._out, deadline))

    def close(self) -> None:
        self.proc.stdin.close()  # NOTE: the child exits at the end of its input
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


def _plain_scope(scope) -> dict:
    """The request's ASGI scope as JSON (bytes as latin-1)."""
    keep = ("type", "http_version", "method", "scheme", "path", "root_path", "client", "server")
    plain = {k: scope[k] for k in keep if k in scope}
    plain["raw_path"] = (scope.get("raw_path") or b"").decode("latin-1")
    plain["query_string"] = scope.get("query_string", b"").decode("latin-1")
    plain["headers"] = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]
    return plain


def asgi_scope(plain: dict) -> dict:
    """``_plain_scope`` undone (in the child)."""
    scope = {**plain, "asgi": {"version": "3.0"}, "state": {}}
    scope["raw_path"] = plain["raw_path"].encode("latin-1") or None
    scope["query_string"] = plain["query_string"].encode("latin-1")
    scope["headers"] = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in plain["headers"]]
    for key in ("client", "server"):
        if scope.get(key) is not None:
            scope[key] = tuple(scope[key])
    return scope


def send_frames(fd: int, frames: list[bytes], deadline: float | None) -> None:
    """Write each frame (length, then bytes) to the non-blocking ``fd`` by ``deadline``."""
    for frame in frames:
        for part in (len(frame).to_bytes(8, "big"), frame):
            view = memoryview(part)
            while view:
                _wait(fd, select.POLLOUT, deadline)
                try:
                    view = view[os.write(fd, view[:CHUNK]) :]
                except BlockingIOError:
                    continue


def read_frame(fd: int, deadline: float | None) -> bytes:
    """One frame from ``fd`` by ``deadline`` (None: no limit); EOFError at its end."""
    size = int.from_bytes(_read(fd, 8, deadline), "big")
    return _read(fd, size, deadline)


def _read(fd: int, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        _wait(fd, select.POLLIN, deadline)
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, event: int, deadline: float | None) -> None:
    if deadline is None:
        return
    poll = select.poll()
    poll.register(fd, event)
    left = deadline - time.monotonic()
    if left <= 0 or not poll.poll(left * 1000):
        raise TimeoutError(f"no answer within {TIMEOUT_S:g} s")
