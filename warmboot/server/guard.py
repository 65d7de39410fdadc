"""The ASGI middleware in front of the FastAPI app (``Guard``). Before a request reaches a
route it checks the API key (401) and reads the whole request body up to the configured
limit (413), handing the app a receive that replays it; after the response it counts the
request by endpoint and status code.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI

from warmboot.server.config import ServerConfig
from warmboot.server.errors import ApiError
from warmboot.server.metrics import ServerMetrics

ENDPOINTS = {
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
    "/debug/engine",
}
"""Paths counted under their own name; anything else is counted as ``other``."""


class Guard:
    """ASGI middleware: body size limit (413), API key (401), request counting by status."""

    def __init__(self, app: FastAPI, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._authorize(scope, path)
            if error is None and scope["method"] in ("POST", "PUT"):
                receive, error = await self._buffer_body(receive)
            if error is not None:
                return await error.response()(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _authorize(self, scope, path: str) -> ApiError | None:
        key = self.config.api_key
        if key is None or not path.startswith(("/v1/", "/debug/")):
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode()):
            return None
        return ApiError(
            401, "missing or incorrect API key", "invalid_request_error", code="invalid_api_key"
        )

    async def _buffer_body(self, receive):
        """Read the whole body (bounded); hand the app a receive that replays it."""
        limit, chunks, size = self.config.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return receive, ApiError(400, "client disconnected", "invalid_request_error")
            size += len(message.get("body", b""))
            if size > limit:
                msg = f"the request body exceeds the limit of {limit} bytes"
                return receive, ApiError(413, msg, "invalid_request_error")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None
