"""A raw HTTP/1.1 client over loopback, one request per connection: it times the status line
and every server-sent ``data: {`` event, and can hold, cancel or abandon a request, which an
HTTP library does not let a hostile-load benchmark do (``bench.fairness``, ``bench.soak``)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import time
from collections.abc import Callable

DEADLINE_S = 60.0
"""A probe or a load request with no (complete) answer by then is abandoned."""
ABANDONED = "abandoned at the stop"


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


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
