"""OpenAI's Responses API (``POST /v1/responses``), state-free: a request is turned into the
chat request it amounts to (instructions as the system message, input items as messages,
``text.format`` as the response format), runs through the chat path, and comes back as a
``response`` object or as the documented stream of typed events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from warmboot.outputs import RequestOutput
from warmboot.server import responses as R
from warmboot.server import tools as tools_mod
from warmboot.server.fields import (
    IgnoredByDesign,
    JsonSchema,
    ResponseFormat,
    StreamOptions,
    UnsupportedParameter,
)
from warmboot.server.protocol import ChatCompletionRequest

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(IgnoredByDesign):
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
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    """``effort`` goes to a chat template that reads ``reasoning_effort``."""
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # refused unless at their default
    background: bool = False
    conversation: Any = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None

    _refused = {
        "background": "responses run in the foreground (no stored responses to poll)",
        "conversation": "this server stores no conversations; send the whole input",
        "max_tool_calls": "tool calls are limited by parallel_tool_calls only",
        "prompt": "there are no stored prompt templates; send the instructions",
    }

    def _check(self) -> None:
        self.check_refused()
        if self.truncation == "auto":
            raise UnsupportedParameter(
                "truncation", "truncation auto is not supported: a prompt too long is a 400"
            )
        bad = [i for i in self.include or () if i != "message.output_text.logprobs"]
        if bad:
            raise UnsupportedParameter("include", f"include {bad} is not supported")
        _only_keys("text", self.text, {"format"}, {"verbosity": "medium"})
        _only_keys("reasoning", self.reasoning, {"effort"}, {"summary": None})

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completions request this response amounts to."""
        self._check()
        if self.previous_response_id is not None:
            raise UnsupportedParameter(
                "previous_response_id",
                "previous_response_id is not supported: this server stores no responses; "
                "send the whole conversation as input",
            )
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            tools=_chat_tools(self.tools),
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.top_logprobs is not None,
            top_logprobs=self.top_logprobs,
            response_format=self._format(),
            reasoning_effort=(self.reasoning or {}).get("effort"),
        )

    def _format(self) -> ResponseFormat | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object"):
            return ResponseFormat(type=kind)
        if kind == "json_schema":
            schema = JsonSchema(
                name=fmt.get("name", "response"), schema=fmt.get("schema"), strict=fmt.get("strict")
            )
            return ResponseFormat(type="json_schema", json_schema=schema)
        raise UnsupportedParameter("text", f"text.format type {kind!r} is not supported")


def _only_keys(field: str, value: dict | None, known: set[str], defaults: dict) -> None:
    """A 400 for keys of an option object other than ``known`` or at their default."""
    for key, v in (value or {}).items():
        if key not in known and (key not in defaults or v != defaults[key]):
            raise UnsupportedParameter(field, f"{field}.{key} is not supported")


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise UnsupportedParameter("input", "the input is empty")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # NOTE: parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "message" and "role" in item:
            role = "system" if item["role"] == "developer" else item["role"]
            if role not in ("system", "user", "assistant"):
                raise UnsupportedParameter("input", f"input item {i} has an unknown role {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        else:
            raise UnsupportedParameter("input", f"input item {i} of type {kind!r} is not supported")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools (nested under ``function``)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise UnsupportedParameter(
                "tools",
                f"tools[{i}] of type {tool.get('type')!r} is not supported (function tools are)",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedParameter(
                "input", f"input item {i}: content parts of type {kind!r} are not supported"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


# -- the response object and its events ----------------------------------------------------------
class ResponseBuilder:
    """One response's ids and settings; builds its body and stream events."""

    def __init__(self, body: ResponsesRequest, meta: R.ResponseMeta, tool_plan=None):
        self.body, self.meta, self.tool_plan = body, meta, tool_plan
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0

    def finished(self, out: RequestOutput) -> dict:
        """The body once the output is final (``_Api._deliver``)."""
        return self.response(out)

    def response(self, out: RequestOutput | None) -> dict:
        """The response object: in progress (``out`` None) or final."""
        status, incomplete, output, usage = "in_progress", None, [], None
        if out is not None:
            c = out.outputs[0]
            status = "incomplete" if c.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output = self._output(c)
            usage = _usage(out)
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.meta.model,
            "output": output,
            "usage": usage,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "metadata": b.metadata or {},
            "store": False,
        }

    def _output(self, c) -> list[dict]:
        """The output items: the message (unless only calls came), then one per call."""
        logprobs = R.chat_lp(self.meta, c, 0)
        if self.tool_plan is None:
            return [self._message(c.text, "completed", logprobs)]
        plan, cut = self.tool_plan, c.finish_reason == "length"
        content, calls = tools_mod.parse(plan.fmt, c.text, set(plan.names), cut)
        items = [self._message(content.strip(), "completed", logprobs)] if content.strip() else []
        return items + [_function_call(call) for call in calls]

    def _message(self, text: str, status: str, logprobs: dict | None = None) -> dict:
        part = self._part(text, logprobs)
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [part],
        }

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
        finished ``RequestOutput`` once they are exhausted. With tools, text that may begin a
        call is held back, and each call goes out at the end as a ``function_call`` item."""
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        stream = tools_mod.ToolStream(self.tool_plan) if self.tool_plan else None
        opened, held = stream is None, ""
        if opened:  # NOTE: without tools the message is the whole output: open it at once
            for event in self._open_message():
                yield event
        async for delta in deltas:
            text = held + (stream.feed(delta) if stream else delta)
            if not opened and not text.strip():
                held = text  # with tools, a message opens only for real text (not a call)
                continue
            if not opened:
                opened = True
                for event in self._open_message():
                    yield event
            held = ""
            yield self._text_delta(text)
        done = self.response(final())
        cut = done["status"] == "incomplete"
        rest = (held + stream.finish(cut)[0]) if stream else ""
        if rest.strip() and not opened:
            opened = True
            for event in self._open_message():
                yield event
        if rest and opened:
            yield self._text_delta(rest)
        for index, item in enumerate(done["output"]):
            for event in self._close_item(index, item):
                yield event
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield self.event(kind, response=done)

    def _open_message(self) -> list[dict]:
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event(
                "response.output_item.added", output_index=0, item=self._message("", "in_progress")
            ),
            self.event("response.content_part.added", **at, part=self._part("")),
        ]

    def _text_delta(self, text: str) -> dict:
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return self.event("response.output_text.delta", **at, delta=text, logprobs=[])

    def _close_item(self, index: int, item: dict) -> list[dict]:
        if item["type"] == "message":
            at = {"item_id": self.item_id, "output_index": index, "content_index": 0}
            part = item["content"][0]
            return [
                self.event("response.output_text.done", **at, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **at, part=part),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        at = {"item_id": item["id"], "output_index": index}
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def _function_call(call: tools_mod.ToolCall) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed" if call.complete else "incomplete",
    }


def _usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
