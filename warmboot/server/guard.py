"""The ASGI middleware in front of the FastAPI app (``Guard``). Before a request reaches a
route it checks the API key (401) and reads the whole request body, whatever the method, up to
the configured limit (413, at once when the declared length is over it), handing the app a
receive that replays it; after the response it counts the request by endpoint and status code.
An error answered before the body is all read closes the connection (its rest is not read).
A large body is screened in a child process first (``body_parse``): a request the app would
refuse early is answered from there, never parsed on the event loop.
"""

from __future__ import annotations

import hmac
import json
import re
import zlib

from fastapi import FastAPI
from starlette.responses import Response

from warmboot.server.body_parse import MAX_WAITING, Screen
from warmboot.server.config import ServerConfig
from warmboot.server.errors import ApiError, body_parse_error
from warmboot.server.metrics import ServerMetrics

ENDPOINTS = {
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
    "/debug/engine",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/version",
    "/openapi.json",
}
"""Paths counted under their own name; anything else is counted as ``other``."""
PROTECTED = ("/v1/", "/debug/", "/tokenize", "/detokenize", "/tokenizer_info")
"""Paths that need the API key when one is set (health, metrics, version and the OpenAPI
document do not)."""


class Guard:
    """ASGI middleware: body size limit (413), API key (401), request counting by status."""

    def __init__(self, app: FastAPI, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.state = app.state
        self.screen = Screen(config)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            try:
                return await self.app(scope, receive, send)
            finally:
                self.screen.close()
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._authorize(scope, path) or self._declared_too_large(scope)
            body = b""
            if error is None:
                body, error = await self._read_body(receive)
            if error is not None:  # NOTE: the body's rest is unread: the connection must go
                response = error.response(path)
                if _has_body(scope):
                    response.headers["connection"] = "close"
                return await response(scope, receive, counting_send)
            if scope["method"] in ("POST", "PUT"):
                try:
                    scope, body = decoded_body(scope, body, self.config.max_body_bytes)
                    refused = await self._screened(scope, body)
                    if refused is None:
                        check_text(body)
                except ApiError as e:
                    refused = e.response(path)
                if refused is not None:
                    return await refused(scope, receive, counting_send)
            await self.app(scope, replay_body(body, receive), counting_send)
        finally:
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _authorize(self, scope, path: str) -> ApiError | None:
        key = self.config.api_key
        if key is None or not path.startswith(PROTECTED):
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.strip().partition(" ")
        # NOTE: auth schemes are case-insensitive (RFC 9110); Anthropic's clients send the key
        # as x-api-key
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        x_api_key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
        if any(t and hmac.compare_digest(t.encode(), key.encode()) for t in (bearer, x_api_key)):
            return None
        return ApiError(
            401, "missing or incorrect API key", "invalid_request_error", code="invalid_api_key"
        )

    async def _screened(self, scope, body: bytes) -> Response | None:
        """The app's early refusal of a large body, found in a child process; else None."""
        llm = self.state.holder.llm
        if not self.screen.wants(scope, body) or llm is None or getattr(llm, "dead", None):
            return None  # NOTE: an engine not (or no longer) ready: the app answers 503
        if self.screen.waiting >= MAX_WAITING:
            error = ApiError(
                429,
                f"{MAX_WAITING} large request bodies are waiting to be read; retry shortly",
                "rate_limit_error",
                code="server_overloaded",
            )
            response = error.response(scope["path"])
            response.headers["Retry-After"] = "1"
            return response
        tok = llm.tokenizer
        facts = {
            "max_model_len": llm.max_model_len,
            "max_token_chars": tok.max_token_chars,
            "vocab_size": len(tok),
            "chat_template": tok.chat_template,
            "adapters": self.state.adapters.names(),  # NOTE: a request may name one
        }
        found = await self.screen.refusal(scope, facts, body)
        if found is None:
            return None
        status, content = found
        return Response(content, status, media_type="application/json")

    def _declared_too_large(self, scope) -> ApiError | None:
        length = dict(scope["headers"]).get(b"content-length", b"0")
        limit = self.config.max_body_bytes
        if length.isdigit() and int(length) > limit:
            return ApiError(413, _too_large(limit), "invalid_request_error")
        return None

    async def _read_body(self, receive) -> tuple[bytes, ApiError | None]:
        """The whole body, or the error that stopped reading it (over the limit, a hang-up)."""
        limit, chunks, size = self.config.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", ApiError(400, "client disconnected", "invalid_request_error")
            size += len(message.get("body", b""))
            if size > limit:
                return b"", ApiError(413, _too_large(limit), "invalid_request_error")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> str:
    return f"the request body exceeds the limit of {limit} bytes"


def _has_body(scope) -> bool:
    headers = dict(scope["headers"])
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0"


def replay_body(body: bytes, receive):
    """A receive that gives ``body`` first, then whatever the connection says (a hang-up)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate, paired or not: the prefilter of ``_has_lone_surrogate``."""


def decoded_body(scope, body: bytes, limit: int) -> tuple[dict, bytes]:
    """gzip or deflate undone (within ``limit``); a JSON content type whatever the client sent
    (``curl -d``). Raise ``ApiError`` (400, 413 or 415) naming the problem."""
    headers = dict(scope["headers"])
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding in ("gzip", "deflate"):
        body = _inflate(body, encoding, limit)
    elif encoding not in ("", "identity"):
        raise ApiError(
            415,
            f"unsupported content-encoding {encoding!r}; use gzip or deflate",
            "invalid_request_error",
        )
    headers.pop(b"content-encoding", None)
    headers[b"content-length"] = str(len(body)).encode()
    # NOTE: every body is JSON, whatever type was sent (curl -d sends a form type)
    headers[b"content-type"] = b"application/json"
    return {**scope, "headers": list(headers.items())}, body


def check_text(body: bytes) -> None:
    """A 400 (``ApiError``) for a body that is not UTF-8 or holds an unpaired surrogate
    escape."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"the request body is not valid UTF-8 (byte {e.start})", "invalid_request_error"
        ) from None
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(body):
        raise ApiError(
            400,
            "the request body holds an unpaired UTF-16 surrogate escape "
            "(such as \\ud800): not valid Unicode text",
            "invalid_request_error",
        )


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise ApiError(
            400, f"the {encoding} request body is corrupt: {e}", "invalid_request_error"
        ) from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise ApiError(
            413,
            f"the decompressed request body exceeds the limit of {limit} bytes",
            "invalid_request_error",
        )
    return out


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether the JSON body decodes to a string holding an unpaired surrogate (the exact
    check behind the regex prefilter; a body that is not JSON is left to the app)."""
    try:
        data = json.loads(body)
    except RecursionError as e:
        raise body_parse_error(e) from None
    except ValueError:
        return False
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
