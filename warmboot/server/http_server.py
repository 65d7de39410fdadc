"""The HTTP server under the API: uvicorn, with limits on what one connection may hold.

``http_config(app, limits, **options)`` builds the ``uvicorn.Config``. Its protocol (uvicorn's
httptools one, or its h11 one where httptools is missing) adds to uvicorn's keep-alive timeout:

- a request head (request line and headers) over ``max_header_bytes``: 431, closed. Counted as
  the bytes arrive, so a huge header costs O(limit) (httptools alone has no limit, and
  accumulates a long header quadratically);
- a head not complete ``header_timeout_s`` after the connection opened (or after the first
  byte of a later request on it): closed, with a 408 when part of it came;
- a request body that stalls for ``body_timeout_s``: 408, closed;
- more than ``max_connections`` open: the connection idle the longest (no request in flight)
  is closed for the new one, or the new one is refused (503) when every one is busy.

Its error bodies are JSON in OpenAI's shape (Anthropic's under ``/v1/messages``), the 400 for
a request that is not HTTP included.
"""

from __future__ import annotations

import asyncio
import http
import resource

import uvicorn

from warmboot.server.config import HttpLimits
from warmboot.server.errors import ApiError

FD_RESERVE = 128
"""File descriptors kept out of the connection cap (model files, logs, the engine's own)."""


def http_config(app, limits: HttpLimits | None = None, **options) -> uvicorn.Config:
    """A ``uvicorn.Config`` serving ``app`` with ``limits``; ``options`` go to uvicorn
    (host, port, log_level, access_log, ...), bar ``http`` and ``timeout_keep_alive``."""
    limits = limits or HttpLimits()
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # NOTE: uvicorn without its [standard] extras
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    cap = _connection_cap(limits.max_connections)
    attrs = {"limits": limits, "max_connections": cap}
    protocol = type(f"Limited{Base.__name__}", (_Limited, Base), attrs)
    return uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=limits.keep_alive_timeout_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **{"ws": "none", **options},
    )


def _connection_cap(wanted: int) -> int:
    """``wanted``, lowered to leave ``FD_RESERVE`` descriptors under the soft fd limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - FD_RESERVE))


class _Limited:
    """The limits, over a uvicorn HTTP protocol (``self.cycle`` is the latest request)."""

    limits: HttpLimits
    max_connections: int

    # -- connection events

    def connection_made(self, transport) -> None:
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_seen = self._idle_since = self.loop.time()
        super().connection_made(transport)
        self._arm_head_timer()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        while data and not self.transport.is_closing():
            if not self._awaiting_head():
                self._body_seen = self.loop.time()
                self._feed(data)
                return
            if self._head_timer is None:  # NOTE: the first byte of a later request
                self._arm_head_timer()
            room = self.limits.max_header_bytes - self._head_bytes
            part, data = data[:room], data[room:]
            self._head_bytes += len(part)
            done = bool(part) and self._feed(part)
            if data and not done and not self.transport.is_closing():
                limit = self.limits.max_header_bytes
                msg = f"the request line and headers exceed the limit of {limit} bytes"
                return self._reject(431, msg)

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._reject(400, "the request is not valid HTTP/1.1")

    # -- state

    def _awaiting_head(self) -> bool:
        """Whether the next bytes belong to a request head (none yet, or the body is in)."""
        return self.cycle is None or not self.cycle.more_body

    def _idle(self) -> bool:
        busy = self.cycle is not None and not self.cycle.response_complete
        return not busy and not self.transport.is_closing()

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; whether a request head completed in it."""
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is cycle:
            return False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body_seen = self.loop.time()
        if self.cycle.more_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timeout)
        return True

    # -- timers

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        if not self._idle():  # NOTE: a response under way; the next head may wait for it
            return self._arm_head_timer()
        if not self._head_bytes:  # NOTE: silent: nothing to answer
            return self._close()
        msg = f"the request head did not arrive within {self.limits.header_timeout_s:g} s"
        self._reject(408, msg)

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._awaiting_head():
            return
        now, timeout = self.loop.time(), self.limits.body_timeout_s
        if self.flow.read_paused:  # NOTE: the app is not reading: not the client's stall
            self._body_seen = now
        if now - self._body_seen < timeout:
            wait = timeout - (now - self._body_seen)
            self._body_timer = self.loop.call_later(wait, self._body_timeout)
            return
        if self.cycle.response_complete:  # NOTE: answered without the body: nothing to say
            return self._close()
        self._reject(408, f"the request body stalled: nothing came for {timeout:g} s")

    # -- closing

    def _make_room(self) -> None:
        """Over the cap: close the connection idle the longest, or refuse this one."""
        idle = [c for c in self.connections if isinstance(c, _Limited) and c is not self]
        idle = [c for c in idle if c._idle()]
        if idle:
            min(idle, key=lambda c: c._idle_since)._close()
        else:
            self._reject(503, "too many open connections; retry later", "service_unavailable")

    def _close(self) -> None:
        self.connections.discard(self)  # NOTE: at once, so the cap counts it out now
        self.transport.close()

    def _reject(self, status: int, message: str, type_: str = "invalid_request_error") -> None:
        """Answer ``status`` (unless a response has begun) and close; a request in flight
        sees a disconnect."""
        if self.transport.is_closing():
            return
        cycle, path, started = self.cycle, "", False
        if cycle is not None and not cycle.response_complete:
            path, started = cycle.scope.get("path", ""), cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
        if not started:
            self.transport.write(self._error_bytes(status, message, type_, path))
        self._close()

    def _error_bytes(self, status: int, message: str, type_: str, path: str) -> bytes:
        body = ApiError(status, message, type_).response(path).body
        phrase = http.HTTPStatus(status).phrase
        lines = [f"HTTP/1.1 {status} {phrase}".encode()]
        lines += [name + b": " + value for name, value in self.server_state.default_headers]
        lines += [b"content-type: application/json", b"content-length: %d" % len(body)]
        lines += [b"connection: close", b"", b""]
        return b"\r\n".join(lines) + body
