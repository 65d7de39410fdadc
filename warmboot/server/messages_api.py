"""Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``), for
Claude-style agent clients. A request becomes the chat completions request it amounts to
(``chat_request``), runs through the chat path (template, tool grammar and parser), and comes
back as a ``message`` object or as Anthropic's stream of events (``MessageBuilder``). Errors on
these routes take Anthropic's shape (``errors``).

What becomes of each field:

- honoured: ``model``, ``messages`` (string content, or ``text``, ``tool_use`` and
  ``tool_result`` blocks), ``system`` (a string or text blocks), ``max_tokens`` (required, as
  Anthropic requires; capped by the context), ``stop_sequences``, ``temperature``, ``top_p``,
  ``top_k``, ``tools`` (name, description, input_schema; ``strict`` always holds: calls are
  constrained to the schema), ``tool_choice`` (auto, any, tool, none;
  ``disable_parallel_tool_use``), ``stream``; a last assistant message of text is a prefill
  the model continues.
- ignored by design: ``metadata`` (a user id only), ``cache_control`` (top level, on blocks and
  on tools: the prefix cache needs no markers), ``service_tier`` auto or standard_only (there is
  one tier), ``thinking`` disabled or adaptive (adaptive leaves thinking to the model, and not
  thinking is within it).
- refused with a 400 naming the field: ``thinking`` enabled (no thinking blocks come back),
  every other field and block type (images, documents, server tools, ...) including unknown
  ones, and a prefill holding ``tool_use``.

Rendering: a message's text blocks are joined by newlines; ``tool_result`` blocks become tool
messages ahead of the user's text (Anthropic puts them first); an ``is_error`` result reads
``Error: ...`` to the model. Text that is all blank comes back as no block at all: Anthropic
refuses blank text blocks, so a client could not send it back.

A call cut short (by ``max_tokens`` or a stop sequence) never comes back partial, as Anthropic
never returns a partial ``tool_use``: one whose input was whole (only its closing markup was
cut) comes back as a ``tool_use`` block, one cut inside its input is dropped; the text before
it comes back either way, and the stop reason says what cut it. Call markup never shows as
text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.outputs import RequestOutput
from warmboot.server import tools as tools_mod
from warmboot.server.errors import anthropic_error_body
from warmboot.server.fields import UnsupportedParameter
from warmboot.server.protocol import ChatCompletionRequest

Cache = dict[str, Any] | None
"""A ``cache_control`` marker: accepted, ignored."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Cache = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None
    """Only as a response carries it back: empty."""


class _DirectCaller(_Strict):
    type: Literal["direct"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Cache = None
    caller: _DirectCaller | None = None
    """Only as a response carries it back: the model called the tool."""
    toolset_name: None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] | str = ""
    is_error: bool = False
    cache_control: Cache = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: list[Block] | str


class Tool(_Strict):
    type: Literal["custom"] | None = None
    """First, so that a server tool (``web_search_...``) is refused for its type."""
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: Cache = None

    def chat(self) -> dict:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def chat(self) -> Any:
        if self.type == "tool":
            if self.name is None:
                raise UnsupportedParameter("tool_choice", "tool_choice type tool needs a name")
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """The prompt's fields: what ``count_tokens`` takes, and the base of a message request."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: list[TextBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    cache_control: Cache = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completions request this one amounts to (known fields only)."""
        if (self.thinking or {}).get("type", "disabled") not in ("disabled", "adaptive"):
            raise UnsupportedParameter(
                "thinking",
                "extended thinking is not supported: this server returns no thinking blocks",
            )
        messages = self._system() + [m for msg in self.messages for m in _chat_messages(msg)]
        prefill = messages[-1]["role"] == "assistant"
        if prefill and (messages[-1].get("tool_calls") or not messages[-1]["content"]):
            raise UnsupportedParameter(
                "messages", "a final assistant message (prefill) must hold text, and no tool_use"
            )
        choice = self.tool_choice
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            tools=[tool.chat() for tool in self.tools] if self.tools else None,
            tool_choice=choice.chat() if choice else None,
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            **self._sampling(),
        )

    def _system(self) -> list[dict]:
        if not self.system:
            return []
        text = self.system if isinstance(self.system, str) else _joined(self.system)
        return [{"role": "system", "content": text}]

    def _sampling(self) -> dict:
        return {}


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    stream: bool = False

    def _sampling(self) -> dict:
        return {
            "max_completion_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _chat_messages(msg: Message) -> list[dict]:
    """One Anthropic message as chat messages: an assistant turn (text and tool calls), or a
    user turn's tool results as tool messages, then its text."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    kinds = {"user": (TextBlock, ToolResultBlock), "assistant": (TextBlock, ToolUseBlock)}
    for block in msg.content:
        if not isinstance(block, kinds[msg.role]):
            raise UnsupportedParameter(
                "messages", f"{block.type} blocks cannot come from the {msg.role}"
            )
    text = _joined([b for b in msg.content if isinstance(b, TextBlock)])
    if msg.role == "assistant":
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in msg.content
            if isinstance(b, ToolUseBlock)
        ]
        return [{"role": "assistant", "content": text or None, "tool_calls": calls or None}]
    results = [b for b in msg.content if isinstance(b, ToolResultBlock)]
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in results]
    if text or not results:
        out.append({"role": "user", "content": text})
    return out


# -- the message object and its events -----------------------------------------------------------
class MessageBuilder:
    """One message's id and settings; builds its body and its stream of events."""

    def __init__(self, model: str, input_tokens: int, stops: list[str] | None, tool_plan=None):
        self.model, self.input_tokens, self.tool_plan = model, input_tokens, tool_plan
        self.stops = set(stops or ())
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def finished(self, out: RequestOutput) -> dict:
        """The body once the output is final (``_Api._deliver``)."""
        return self.message(out)

    def message(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text, calls = self._split(c)
        content = [_text_block(text)] if text.strip() else []
        content += [_tool_use(call) for call in calls]
        return self._body(content, *self._stop(c, calls), len(c.token_ids))

    def _body(self, content: list[dict], stop_reason, stop_sequence, output_tokens: int) -> dict:
        usage = {"input_tokens": self.input_tokens, "output_tokens": output_tokens}
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def _split(self, c) -> tuple[str, list[tools_mod.ToolCall]]:
        """(text, calls) of output ``c``: the text less the calls and any call cut short; one
        whose input was whole (only its closing markup was cut) is kept."""
        plan = self.tool_plan
        if plan is None:
            return c.text, []
        cut = c.finish_reason == "length" or isinstance(c.stop_reason, str)
        content, calls = tools_mod.parse(plan.fmt, c.text, set(plan.names), cut)
        return content, [call for call in calls if call.complete]

    def _stop(self, c, calls: list) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if c.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stops:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    async def events(self, deltas: AsyncIterator[str], final: Callable[[], RequestOutput]):
        """Anthropic's event sequence around the text ``deltas``; ``final()`` gives the finished
        output once they are exhausted. A failure ends the stream with an ``error`` event."""
        try:
            async for event in self._events(deltas, final):
                yield event
        except (EngineDeadError, InvalidRequestError, ValueError) as e:
            status = 500 if isinstance(e, EngineDeadError) else 400
            yield anthropic_error_body(status, str(e))

    async def _events(self, deltas, final) -> AsyncIterator[dict]:
        yield {"type": "message_start", "message": self._body([], None, None, 0)}
        yield {"type": "ping"}
        stream = tools_mod.ToolStream(self.tool_plan) if self.tool_plan else None
        sent, held = "", ""  # NOTE: the text block opens on the first text that is not blank
        async for delta in deltas:
            held += stream.feed(delta) if stream else delta
            if held.strip() or (sent and held):
                if not sent:
                    yield _block_start(0, _text_block(""))
                yield _delta(0, {"type": "text_delta", "text": held})
                sent, held = sent + held, ""
        out = final()
        c = out.outputs[0]
        text, calls = self._split(c)
        rest = text[len(sent) :] if text.startswith(sent) else ""
        if rest and (sent or rest.strip()):
            if not sent:
                yield _block_start(0, _text_block(""))
            yield _delta(0, {"type": "text_delta", "text": rest})
            sent += rest
        first = 1 if sent else 0
        if sent:
            yield {"type": "content_block_stop", "index": 0}
        for index, call in enumerate(calls, first):
            block = _tool_use(call)
            yield _block_start(index, {**block, "input": {}})
            yield _delta(index, {"type": "input_json_delta", "partial_json": call.arguments})
            yield {"type": "content_block_stop", "index": index}
        stop_reason, stop_sequence = self._stop(c, calls)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": len(c.token_ids)}
        yield {"type": "message_delta", "delta": delta, "usage": usage}
        yield {"type": "message_stop"}


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _tool_use(call: tools_mod.ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}
