"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, responses,
Anthropic's messages, models, tokenizer routes, health, metrics. The engine runs on its own thread behind ``AsyncLLM``; handlers only validate,
queue, and format. ``create_app`` wires the routes here to the error handlers
(``errors``), the middleware (``guard``), stream reading (``streams``) and delivery to the
client (``delivery``).

A client that goes away aborts its requests: streaming responses are cancelled by Starlette
when the connection drops, and non-streaming ones race the generation against the
connection's disconnect message.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from warmboot import __version__
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams
from warmboot.server import chunks as chunks_mod
from warmboot.server import responses as R
from warmboot.server import tools as tools_mod
from warmboot.server.adapters import ServedAdapters, UnknownModel, parse_lora_modules
from warmboot.server.admission import Admission, Overloaded, check_length, client_of, least_tokens
from warmboot.server.chat_render import chat_prompt
from warmboot.server.config import ServerConfig
from warmboot.server.delivery import json_body, sse, until_disconnect
from warmboot.server.engine_holder import EngineHolder
from warmboot.server.errors import install_errors, model_not_found
from warmboot.server.fields import UnsupportedParameter
from warmboot.server.guard import Guard
from warmboot.server.lora_routes import model_routes
from warmboot.server.messages_api import CountTokensRequest, MessageBuilder, MessagesRequest
from warmboot.server.metrics import ServerMetrics
from warmboot.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from warmboot.server.responses_api import ResponseBuilder, ResponsesRequest
from warmboot.server.streams import StreamReader, UsageSoFar, add_all

__all__ = ["ServerConfig", "create_app"]
TOKENIZE_CONTEXTS = 16
"""``/tokenize`` takes texts of up to this many contexts (lm-eval splits long documents)."""


def create_app(holder: EngineHolder, config: ServerConfig) -> Guard:
    """The ASGI app: FastAPI routes behind the guard middleware."""
    metrics = ServerMetrics(holder.state)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # NOTE: here, not after uvicorn.run returns: uvicorn re-raises SIGTERM once it has
        # shut down, so code after it may never run; the worker and its sandbox must go.
        await asyncio.to_thread(holder.shutdown)

    app = FastAPI(
        title="warmboot",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    startup = parse_lora_modules(config.lora_modules, config.served_model_name)
    adapters = ServedAdapters(config.served_model_name, startup)
    if startup:  # NOTE: a bad adapter fails the boot (a crashed engine's too, named again)
        holder.prepare = adapters.prepare
    app.state.holder, app.state.metrics, app.state.adapters = holder, metrics, adapters
    app.openapi = _openapi(app, [config.served_model_name, *adapters.names()])
    install_errors(app)
    api = _Api(holder, config, metrics, adapters)
    model_routes(holder, adapters).install(app, _get_and_head)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", api.tokenizer_info, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/responses", api.responses, methods=["POST"])
    app.add_api_route("/v1/messages", api.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])
    _get_and_head(app, "/health", api.health)
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])
    if config.enable_debug:
        app.add_api_route("/debug/engine", api.debug_engine, methods=["GET"])
    return Guard(app, config, metrics)


def _get_and_head(app: FastAPI, path: str, endpoint) -> None:
    """A GET route that answers HEAD too (load balancers probe with HEAD)."""
    app.add_api_route(path, endpoint, methods=["GET"])
    app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)


# -- endpoints ---------------------------------------------------------------------------------
class _Api:
    def __init__(self, holder: EngineHolder, config: ServerConfig, metrics, adapters):
        self.holder, self.config, self.metrics = holder, config, metrics
        self.adapters: ServedAdapters = adapters
        self.reader = StreamReader(metrics)
        self.admission = Admission(config.admission, metrics)

    async def version(self) -> dict:
        return {"version": __version__}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        llm = self.holder.require()
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise UnsupportedParameter("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            self._check_chat_length(llm, body.chat(), body.tools)
            render = chat_prompt, llm.tokenizer, body.chat(), body.tools, self.config
            tokens = (await asyncio.to_thread(*render))["prompt_token_ids"]
        else:
            special = body.add_special_tokens is not False
            limit = TOKENIZE_CONTEXTS * llm.max_model_len  # NOTE: lm-eval's rolling windows
            check_length(
                len(body.prompt), llm.tokenizer.max_token_chars, limit, "prompt", "the prompt is"
            )
            tokens = await asyncio.to_thread(llm.tokenizer.encode, body.prompt, special)
        out = {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            out["token_strs"] = [llm.tokenizer.token_text(t) for t in tokens]
        return out

    async def tokenizer_info(self) -> dict:
        """vLLM's: the special tokens and the chat template (lm-eval's remote tokenizer)."""
        llm = self.holder.require()
        tok = llm.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": len(tok),
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": llm.max_model_len,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        llm = self.holder.require()
        if body.model is not None:
            self._check_model(body.model)
        vocab = len(llm.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise UnsupportedParameter("tokens", f"token ids {bad[:5]} are outside [0, {vocab})")
        return {"prompt": llm.tokenizer.decode(body.tokens, False)}

    async def health(self) -> JSONResponse:
        self.holder.check_alive()  # NOTE: a dead engine's replacement starts booting now
        if self.holder.llm is not None:
            path, reason = self.holder.start_path()
            return JSONResponse({"status": "ok", "start_path": path, "start_reason": reason})
        died = self.holder.died
        status = "failed" if self.holder.error else "restarting" if died else "starting"
        body = {"status": status, "error": self.holder.error, "phase": self.holder.phase}
        return JSONResponse(body | ({"engine_died": died} if died else {}), status_code=503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def debug_engine(self) -> dict:
        return await self.holder.require().debug_state()

    def _check_model(self, model: str):
        """The LoRA adapter ``model`` names (None: the base); a 404 if it names neither."""
        try:
            return self.adapters.lora_request(model)
        except UnknownModel as e:
            raise model_not_found(e.model, e.served) from None

    def _meta(self, prefix: str, params: SamplingParams, llm, body) -> R.ResponseMeta:
        """``body``: the request; its ``request_id`` (vLLM's) names the response."""
        token_text = llm.tokenizer.token_text
        if body.return_tokens_as_token_ids:
            token_text = R.token_id_text
        return R.ResponseMeta(
            id=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
            model=body.model,
            created=int(time.time()),
            n=params.n,
            top_logprobs=params.logprobs,
            token_bytes=llm.tokenizer.token_bytes,
            token_text=token_text,
            token_ids_as_text=body.return_tokens_as_token_ids,
        )

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        llm = self.holder.require()
        lora = self._check_model(body.model)
        params = body.sampling_params()
        prompts = body.prompts()
        mtc = llm.tokenizer.max_token_chars
        least = sum(least_tokens(len(p), mtc) if isinstance(p, str) else len(p) for p in prompts)
        self.admission.check_cost(len(prompts), params.n, least, params.prompt_logprobs is not None)
        if not body.add_special_tokens:
            prompts = await asyncio.to_thread(_without_specials, llm, prompts)
        streams, ticket = await self._queue(llm, prompts, params, request, lora)
        meta = replace(
            self._meta("cmpl", params, llm, body),
            echo_logprobs=body.echo_logprobs,
            generates=body.generates,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        echo = [_prompt_text(llm, p) for p in prompts] if body.echo else []
        if body.stream:
            so_far = UsageSoFar(body.continuous_usage)
            chunks = chunks_mod.completion_chunks(
                self.reader, meta, streams, echo, body.include_usage, so_far
            )
            return sse(chunks, on_close=ticket.release)
        with _held(ticket):
            outs = await until_disconnect(request, self.reader.finals(streams))
        return await json_body(R.completion_body, meta, outs, echo)

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        llm = self.holder.require()
        lora = self._check_model(body.model)
        tool_plan = self._tool_plan(llm, body)
        params = body.sampling_params(tool_plan.tag if tool_plan else None)
        tools = body.tools if tool_plan else None
        self._check_chat_length(llm, body, body.tools)
        self.admission.check_cost(1, params.n, 0, params.prompt_logprobs is not None)
        prompt = await asyncio.to_thread(chat_prompt, llm.tokenizer, body, tools, self.config)
        (stream,), ticket = await self._queue(llm, [prompt], params, request, lora)
        meta = self._meta("chatcmpl", params, llm, body)
        meta = replace(meta, prompt_logprobs=body.prompt_logprobs is not None)
        if body.stream:
            so_far = UsageSoFar(body.continuous_usage)
            chunks = chunks_mod.chat_chunks(
                self.reader, meta, stream, params.n, body.include_usage, so_far, tool_plan
            )
            return sse(chunks, on_close=ticket.release)
        with _held(ticket):
            (out,) = await until_disconnect(request, self.reader.finals([stream]))
        return await json_body(R.chat_body, meta, out, tool_plan)

    async def _queue(self, llm, prompts: list, params: SamplingParams, request: Request, lora):
        """(streams, ticket): the prompts queued once admitted, with the LoRA adapter
        ``lora`` (None: the base); the ticket holds their share of the capacity until
        released."""
        client = client_of(request, self.config.client_id_header)
        await self.adapters.ready(llm)
        ticket = self.admission.admit(len(prompts) * params.n, client)
        try:
            streams = await add_all(llm, prompts, params, client, lora)
        except BaseException:
            ticket.release()
            raise
        try:
            ticket.add_tokens(sum(s.num_prompt_tokens for s in streams))
        except Overloaded:
            self.reader.abort(streams)
            raise
        return streams, ticket

    def _check_chat_length(self, llm, chat: ChatCompletionRequest, tools) -> None:
        """Refuse a conversation too long for the context before rendering it."""
        limit = llm.max_model_len
        if len(chat.messages) > limit:  # NOTE: a template writes a token or more per message
            raise UnsupportedParameter(
                "messages", f"{len(chat.messages)} messages cannot fit a context of {limit} tokens"
            )
        chars = sum(len(m.text()) for m in chat.messages)
        chars += len(json.dumps(tools)) if tools else 0
        check_length(
            chars, llm.tokenizer.max_token_chars, limit, "messages", "the messages and tools are"
        )

    def _tool_plan(self, llm, body: ChatCompletionRequest):
        fmt = self.config.tool_call_parser
        if fmt == "auto":
            fmt = tools_mod.detect_format(llm.tokenizer.chat_template)
        return tools_mod.plan(body.tools, body.tool_choice, body.parallel_tool_calls, fmt)

    # -- /v1/responses ------------------------------------------------------------------------
    async def responses(self, body: ResponsesRequest, request: Request):
        chat = body.chat_request()
        llm, tool_plan, prompt, lora = await self._chat_like(body.model, chat)
        params = chat.sampling_params(tool_plan.tag if tool_plan else None)
        builder = ResponseBuilder(body, self._meta("resp", params, llm, chat), tool_plan)
        return await self._deliver(llm, (prompt, lora), params, request, body.stream, builder)

    async def _chat_like(self, model: str, chat: ChatCompletionRequest):
        """(llm, tool plan, prompt, LoRA adapter) of a request that another API's body
        translates into."""
        llm = self.holder.require()
        lora = self._check_model(model)
        tool_plan = self._tool_plan(llm, chat)
        tools = chat.tools if tool_plan else None
        self._check_chat_length(llm, chat, chat.tools)
        prompt = await asyncio.to_thread(chat_prompt, llm.tokenizer, chat, tools, self.config)
        return llm, tool_plan, prompt, lora

    async def _deliver(self, llm, prompt_lora, params, request, streaming: bool, builder):
        """Run one (prompt, LoRA adapter): ``builder``'s typed event stream, or its body once
        finished."""
        prompt, lora = prompt_lora
        self.admission.check_cost(1, params.n, 0, params.prompt_logprobs is not None)
        (stream,), ticket = await self._queue(llm, [prompt], params, request, lora)
        if streaming:
            finals: dict[int, RequestOutput] = {}
            merged = self.reader.merge([stream], finals)
            deltas = _nonempty(out.outputs[0].delta_text async for _, out in merged)
            events = builder.events(deltas, lambda: finals[0])
            return sse(events, typed=True, on_close=ticket.release)
        with _held(ticket):
            (out,) = await until_disconnect(request, self.reader.finals([stream]))
        return await json_body(builder.finished, out)

    # -- /v1/messages (Anthropic's) ------------------------------------------------------------
    async def messages(self, body: MessagesRequest, request: Request):
        chat = body.chat_request()
        llm, tool_plan, prompt, lora = await self._chat_like(body.model, chat)
        params = chat.sampling_params(tool_plan.tag if tool_plan else None)
        size = len(prompt["prompt_token_ids"])
        builder = MessageBuilder(body.model, size, body.stop_sequences, tool_plan)
        return await self._deliver(llm, (prompt, lora), params, request, body.stream, builder)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        _, _, prompt, _ = await self._chat_like(body.model, body.chat_request())
        return {"input_tokens": len(prompt["prompt_token_ids"])}


def _openapi(app: FastAPI, models: list[str]):
    """The OpenAPI document, with the model and the start-up LoRA adapters this server
    serves as ``model``'s only values (a client, or a fuzzer, then knows what to send)."""

    def build() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for component in schema.get("components", {}).get("schemas", {}).values():
                prop = component.get("properties", {}).get("model")
                if prop is not None:
                    prop.clear()
                    prop.update({"type": "string", "enum": models, "title": "Model"})
            app.openapi_schema = schema
        return app.openapi_schema

    return build


async def _nonempty(texts: AsyncIterator[str]) -> AsyncIterator[str]:
    async for text in texts:
        if text:
            yield text


def _prompt_text(llm, prompt) -> str:
    if isinstance(prompt, dict):
        return prompt["prompt"]
    return prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt, False)


@contextmanager
def _held(ticket):
    """Release ``ticket`` when the block ends, however it ends."""
    try:
        yield
    finally:
        ticket.release()


def _without_specials(llm, prompts: list) -> list:
    """Text prompts tokenized without special tokens (``add_special_tokens: false``)."""
    encode = llm.tokenizer.encode
    return [
        {"prompt": p, "prompt_token_ids": encode(p, add_special_tokens=False)}
        if isinstance(p, str)
        else p
        for p in prompts
    ]
