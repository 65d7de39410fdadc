"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics. The engine runs on its own thread behind ``AsyncLLM``; handlers only validate,
queue, and format.

A client that goes away aborts its requests: streaming responses are cancelled by Starlette
when the connection drops, and non-streaming ones race the generation against the
connection's disconnect message.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from warmboot.engine.client import RequestStream
from warmboot.engine.errors import EngineDeadError, InvalidRequestError
from warmboot.outputs import OutputFolder, RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.server import responses as R
from warmboot.server.engine_holder import EngineHolder, EngineNotReady
from warmboot.server.metrics import ServerMetrics
from warmboot.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameter,
    error_body,
)

log = logging.getLogger("warmboot")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    """The model id clients must send (``model`` field) and ``/v1/models`` lists."""
    api_key: str | None = None
    """When set, ``/v1/*`` and ``/debug/*`` require ``Authorization: Bearer <key>``."""
    max_body_bytes: int = 4 << 20
    """Larger request bodies get a 413."""
    enable_debug: bool = False
    """Expose ``GET /debug/engine`` (pool invariants and engine counters)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def create_app(holder: EngineHolder, config: ServerConfig) -> _Guard:
    """The ASGI app: FastAPI routes behind the guard middleware."""
    metrics = ServerMetrics(holder.state)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # NOTE: here, not after uvicorn.run returns: uvicorn re-raises SIGTERM once it has
        # shut down, so code after it may never run; the worker and its sandbox must go.
        await asyncio.to_thread(holder.shutdown)

    app = FastAPI(
        title="warmboot", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.holder, app.state.metrics = holder, metrics
    _install_errors(app)
    api = _Api(holder, config, metrics)
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])
    if config.enable_debug:
        app.add_api_route("/debug/engine", api.debug_engine, methods=["GET"])
    return _Guard(app, config, metrics)


# -- errors ------------------------------------------------------------------------------------
def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(UnsupportedParameter)
    async def _unsupported(_: Request, e: UnsupportedParameter):
        return ApiError(400, str(e), "invalid_request_error", e.param).response()

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(_: Request, e: InvalidRequestError):
        return ApiError(400, str(e), "invalid_request_error").response()

    @app.exception_handler(EngineNotReady)
    async def _not_ready(_: Request, e: EngineNotReady):
        return ApiError(503, str(e), "service_unavailable").response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return ApiError(503, str(e), "service_unavailable").response()

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return ApiError(404, f"no route {request.url.path}", "invalid_request_error").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, _):
        msg = f"method {request.method} not allowed on {request.url.path}"
        return ApiError(405, msg, "invalid_request_error").response()


def _validation_error(e: RequestValidationError) -> ApiError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"the request body is not valid JSON: {first.get('msg')}", "invalid_request_error"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None  # NOTE: deeper entries may be pydantic's union branch tags
    msg = first.get("msg", "invalid request")
    text = f"invalid parameter {param}: {msg}" if param else f"invalid request body: {msg}"
    return ApiError(400, text, "invalid_request_error", param)


# -- middleware --------------------------------------------------------------------------------
class _Guard:
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
            endpoint = path if path in _ENDPOINTS else "other"
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


_ENDPOINTS = {
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
    "/debug/engine",
}


# -- endpoints ---------------------------------------------------------------------------------
class _Api:
    def __init__(self, holder: EngineHolder, config: ServerConfig, metrics: ServerMetrics):
        self.holder, self.config, self.metrics = holder, config, metrics

    async def models(self) -> dict:
        card = {"id": self.config.served_model_name, "object": "model", "owned_by": "warmboot"}
        card["created"] = 0
        if self.holder.llm is not None:
            card["max_model_len"] = self.holder.llm.max_model_len
        return {"object": "list", "data": [card]}

    async def health(self) -> JSONResponse:
        if self.holder.llm is not None:
            path, reason = self.holder.start_path()
            return JSONResponse({"status": "ok", "start_path": path, "start_reason": reason})
        status = "failed" if self.holder.error else "starting"
        return JSONResponse({"status": status, "error": self.holder.error}, status_code=503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def debug_engine(self) -> dict:
        return await self.holder.require().debug_state()

    def _check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def _meta(self, prefix: str, params: SamplingParams, llm=None) -> R.ResponseMeta:
        return R.ResponseMeta(
            id=f"{prefix}-{uuid.uuid4().hex}",
            model=self.config.served_model_name,
            created=int(time.time()),
            n=params.n,
            top_logprobs=params.logprobs,
            token_bytes=llm.tokenizer.token_bytes if llm is not None else None,
        )

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        llm = self.holder.require()
        self._check_model(body.model)
        params = body.sampling_params()
        prompts = body.prompts()
        streams = await _add_all(llm, prompts, params)
        meta = self._meta("cmpl", params)
        echo = [_prompt_text(llm, p) for p in prompts] if body.echo else []
        if body.stream:
            chunks = self._completion_chunks(meta, streams, echo, body.include_usage)
            return _sse(chunks)
        outs = await _until_disconnect(request, self._finals(streams))
        return R.completion_body(meta, outs, echo)

    async def _completion_chunks(self, meta, streams, echo, include_usage) -> AsyncIterator[dict]:
        finals: dict[int, RequestOutput] = {}
        sent = _SentChoices()
        async for p, out in self._merge(streams, finals):
            for c in out.outputs:
                if not sent.pending(meta, p, c):
                    continue
                prefix = echo[p] if echo and sent.first(p, c) else ""
                offset = sent.offset(p, c) + len(prefix)
                chunk = R.completion_chunk(meta, p, c, prefix, offset)
                sent.record(p, c, chunk["choices"][0]["logprobs"], offset)
                yield chunk
        if include_usage:
            yield R.usage_chunk(meta, "text_completion", [finals[p] for p in sorted(finals)])

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        llm = self.holder.require()
        self._check_model(body.model)
        params = body.sampling_params()
        prompt = _chat_prompt(llm, body)
        (stream,) = await _add_all(llm, [prompt], params)
        meta = self._meta("chatcmpl", params, llm)
        if body.stream:
            return _sse(self._chat_chunks(meta, stream, params.n, body.include_usage))
        (out,) = await _until_disconnect(request, self._finals([stream]))
        return R.chat_body(meta, out)

    async def _chat_chunks(self, meta, stream, n: int, include_usage) -> AsyncIterator[dict]:
        for i in range(n):
            yield R.chat_chunk(meta, i, {"role": "assistant", "content": ""}, None)
        finals: dict[int, RequestOutput] = {}
        sent = _SentChoices()
        async for _, out in self._merge([stream], finals):
            for c in out.outputs:
                if sent.pending(meta, 0, c):
                    delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
                    chunk = R.chat_chunk(meta, c.index, delta, c)
                    sent.record(p=0, c=c, logprobs=None, offset=0)
                    yield chunk
        if include_usage and finals:
            yield R.usage_chunk(meta, "chat.completion.chunk", [finals[0]])

    # -- shared --------------------------------------------------------------------------------
    async def _finals(self, streams: list[RequestStream]) -> list[RequestOutput]:
        async def last(stream: RequestStream) -> RequestOutput:
            timing, folder = R.Timing(self.metrics), OutputFolder()
            async for out in stream:
                timing.observe(out)
                folder.add(out)
            final = folder.cumulative()
            timing.finish(final)
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            self._abort(streams)

    async def _merge(self, streams: list[RequestStream], finals: dict[int, RequestOutput]):
        """Yield (prompt index, delta output) from several streams as they arrive; each
        stream's whole output goes into ``finals`` when it ends."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            timing, folder = R.Timing(self.metrics), OutputFolder()
            try:
                async for out in stream:
                    timing.observe(out)
                    folder.add(out)
                    if out.finished:
                        finals[p] = folder.cumulative()
                        timing.finish(finals[p])
                    await merged.put((p, out))
            except Exception as e:  # noqa: BLE001 - re-raised in the consumer
                await merged.put((p, e))

        tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                p, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                yield p, item
        finally:
            for task in tasks:
                task.cancel()
            self._abort(streams)

    def _abort(self, streams: list[RequestStream]) -> None:
        """Abort what is still running (the client left, or a sibling prompt failed)."""
        for s in streams:
            s.abort()
        self.metrics.aborted.inc(sum(s.aborted for s in streams))


class _SentChoices:
    """What a stream has sent per choice (prompt index, choice index): whether it started,
    whether its finish went out (an engine output repeats finished siblings' last state), and
    the text offset of its next logprob token."""

    def __init__(self):
        self._ended: set[tuple[int, int]] = set()
        self._offsets: dict[tuple[int, int], int] = {}

    def pending(self, meta: R.ResponseMeta, p: int, c) -> bool:
        """New text, the end, or (with logprobs) new tokens whose text is still held back."""
        if (p, c.index) in self._ended:
            return False
        return bool(
            c.delta_text or c.finished or (meta.top_logprobs is not None and c.delta_token_ids)
        )

    def first(self, p: int, c) -> bool:
        return (p, c.index) not in self._offsets

    def offset(self, p: int, c) -> int:
        return self._offsets.get((p, c.index), 0)

    def record(self, p: int, c, logprobs: dict | None, offset: int) -> None:
        tokens = logprobs["tokens"] if logprobs else ()
        self._offsets[(p, c.index)] = offset + sum(len(t) for t in tokens)
        if c.finished:
            self._ended.add((p, c.index))


async def _add_all(llm, prompts: list, params: SamplingParams) -> list[RequestStream]:
    """Queue every prompt, or none: a bad one aborts those already queued."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            try:
                streams.append(await llm.add_request(prompt, params))
            except InvalidRequestError as e:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise InvalidRequestError(f"{where}{e}") from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


def _prompt_text(llm, prompt) -> str:
    return prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt, False)


def _chat_prompt(llm, body: ChatCompletionRequest) -> dict:
    tokenizer = llm.tokenizer
    try:
        text = tokenizer.apply_chat_template(
            body.conversation(), add_generation_prompt=body.add_generation_prompt
        )
    except ValueError as e:  # no template, or the template rejected the conversation
        raise UnsupportedParameter("messages", f"cannot render the chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja errors raised by the template itself
        raise UnsupportedParameter("messages", f"the chat template failed: {e}") from None
    # NOTE: the template holds any BOS itself; do not add special tokens again.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (EngineDeadError, InvalidRequestError, ValueError) as e:
            error = error_body(
                str(e),
                "server_error" if isinstance(e, EngineDeadError) else "invalid_request_error",
            )
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def _until_disconnect(request: Request, work):
    """Run ``work``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        log.info("client disconnected; request aborted")
        raise ApiError(499, "client disconnected", "invalid_request_error")
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
