"""OpenAI's Responses API (``POST /v1/responses``), state-free: a request is turned into the
chat request it amounts to (instructions as the system message, input items as messages,
``text.format`` as the response format), runs through the chat path, and comes back as a
``response`` object or as the documented stream of typed events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import Field

from warmboot.outputs import RequestOutput
from warmboot.server import responses as R
from warmboot.server.protocol import (
    ChatCompletionRequest,
    JsonSchema,
    ResponseFormat,
    UnsupportedParameter,
    _Model,
)

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Model):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completions request this response amounts to."""
        if self.previous_response_id is not None:
            raise UnsupportedParameter(
                "previous_response_id",
                "previous_response_id is not supported: this server stores no responses; "
                "send the whole conversation as input",
            )
        if self.tools:
            raise UnsupportedParameter("tools", "tools are not supported in /v1/responses yet")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.top_logprobs is not None,
            top_logprobs=self.top_logprobs,
            response_format=self._format(),
            user=self.user,
        )

    def _format(self) -> ResponseFormat | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object"):
            return ResponseFormat(type=kind)
        if kind == "json_schema":
            schema = JsonSchema(name=fmt.get("name", "response"), schema=fmt.get("schema"),
                                strict=fmt.get("strict"))  # fmt: skip
            return ResponseFormat(type="json_schema", json_schema=schema)
        raise UnsupportedParameter("text", f"text.format type {kind!r} is not supported")


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, str]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise UnsupportedParameter("input", "the input is empty")
    out = []
    for i, item in enumerate(items):
        if item.get("type", "message") != "message" or "role" not in item:
            raise UnsupportedParameter("input", f"input item {i} of type "
                                       f"{item.get('type')!r} is not supported")  # fmt: skip
        role = "system" if item["role"] == "developer" else item["role"]
        if role not in ("system", "user", "assistant"):
            raise UnsupportedParameter("input", f"input item {i} has an unknown role {role!r}")
        out.append({"role": role, "content": _text(item.get("content"), i)})
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedParameter("input", f"input item {i}: content parts of type "
                                       f"{kind!r} are not supported")  # fmt: skip
        parts.append(str(part.get("text", "")))
    return "".join(parts)


# -- the response object and its events ----------------------------------------------------------
class ResponseBuilder:
    """One response's ids and settings; builds its body and stream events."""

    def __init__(self, body: ResponsesRequest, meta: R.ResponseMeta):
        self.body, self.meta = body, meta
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0

    def response(self, out: RequestOutput | None, text: str = "") -> dict:
        """The response object: in progress (``out`` None) or final."""
        status, incomplete, output, usage = "in_progress", None, [], None
        if out is not None:
            c = out.outputs[0]
            status = "incomplete" if c.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output = [self._message(c.text, "completed", R._chat_lp(self.meta, c, 0))]
            usage = _usage(out)
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "incomplete_details": incomplete,
            "model": self.meta.model, "output": output, "usage": usage,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": b.text or {"format": {"type": "text"}}, "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True,
            "previous_response_id": None, "metadata": b.metadata or {}, "store": False,
        }  # fmt: skip

    def _message(self, text: str, status: str, logprobs: dict | None = None) -> dict:
        part = self._part(text, logprobs)
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [part]}  # fmt: skip

    @staticmethod
    def _part(text: str, logprobs: dict | None = None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs["content"]
        return part

    def event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    async def events(self, deltas: AsyncIterator[str], final) -> AsyncIterator[dict]:
        """The documented event sequence around the text ``deltas``; ``final()`` gives the
        finished ``RequestOutput`` once they are exhausted."""
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        yield self.event("response.output_item.added", output_index=0,
                         item=self._message("", "in_progress"))  # fmt: skip
        yield self.event("response.content_part.added", **at, part=self._part(""))
        async for delta in deltas:
            yield self.event("response.output_text.delta", **at, delta=delta, logprobs=[])
        out = final()
        done = self.response(out)
        message = done["output"][0]
        yield self.event("response.output_text.done", **at, text=message["content"][0]["text"],
                         logprobs=[])  # fmt: skip
        yield self.event("response.content_part.done", **at, part=message["content"][0])
        yield self.event("response.output_item.done", output_index=0, item=message)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield self.event(kind, response=done)


def _usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
