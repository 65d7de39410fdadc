"""OpenAI request models (pydantic) and their translation into ``SamplingParams``.

Unknown fields are ignored, as OpenAI-compatible servers commonly do; fields that change the
result but are not supported (``best_of`` > n, ``suffix``, ...) are rejected
with a 400 naming them, so a client never silently gets something other than it asked for.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from warmboot.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

MAX_STOP_SEQUENCES = 16
MAX_COMPLETIONS_LOGPROBS = 5


class UnsupportedParameter(ValueError):
    """A request field that warmboot cannot honour; reported as a 400 naming ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchema(_Model):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _SamplingRequest(_Model):
    """Fields shared by both endpoints."""

    model: str
    n: Annotated[int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise UnsupportedParameter(
                "stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed"
            )
        if any(not s for s in stops):
            raise UnsupportedParameter("stop", "stop sequences must be non-empty strings")

    def _params(self, max_tokens: int | None, logprobs: int | None, structured) -> SamplingParams:
        extras = {
            k: v
            for k, v in {
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "prompt_logprobs": self._prompt_logprobs(),
            }.items()
            if v is not None
        }
        try:
            return self._build(max_tokens, logprobs, structured, extras)
        except UnsupportedParameter:
            raise
        except ValueError as e:  # SamplingParams names the field: "... parameter NAME=..."
            found = re.search(r"parameter (\w+)=", str(e))
            raise UnsupportedParameter(found.group(1) if found else None, str(e)) from None

    def _build(self, max_tokens, logprobs, structured, extras: dict) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=structured,
            logit_bias=self._logit_bias(),
            output_kind="delta",  # NOTE: the server folds deltas itself (O(tokens) a request)
            **extras,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's keys are token ids as strings."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not k.strip().isdigit()]
        if bad:
            raise UnsupportedParameter("logit_bias", f"keys must be token ids, got {bad[:3]}")
        return {int(k): float(v) for k, v in self.logit_bias.items()}

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    """0 (with ``echo``): score the prompt, generate nothing."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETIONS_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise UnsupportedParameter("prompt", "the prompt is empty")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "best_of other than n is not supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix (insertion) is not supported")
        if self.max_tokens == 0 and self.min_tokens:
            raise UnsupportedParameter("min_tokens", "min_tokens needs max_tokens >= min_tokens")
        # NOTE: max_tokens=0 runs the prefill with one token, which the response leaves out
        max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
        return self._params(max_tokens, self.logprobs, _structured(self.response_format))

    @property
    def generates(self) -> bool:
        """False for ``max_tokens=0``: the response holds the echoed prompt only."""
        return self.max_tokens != 0

    @property
    def echo_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: the logprobs columns start with the prompt's tokens."""
        return self.echo and self.logprobs is not None

    def _prompt_logprobs(self) -> int | None:
        if not self.echo_logprobs:
            return self.prompt_logprobs
        return max(self.prompt_logprobs or 0, self.logprobs)


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The Hugging Face message shape: tool calls' arguments as objects."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedParameter(
                    "messages", f"content parts of type {part.get('type')!r} are not supported"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def sampling_params(self, tool_tag: dict | None = None) -> SamplingParams:
        """``tool_tag``: the structural tag that enforces this request's tool calls."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs requires logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        structured = _structured(self.response_format)
        if tool_tag is not None:
            if structured is not None:
                raise UnsupportedParameter(
                    "response_format", "response_format and tool calls cannot be combined"
                )
            structured = StructuredOutputs(structural_tag=tool_tag)
        return self._params(max_tokens, logprobs, structured)


class TokenizeRequest(_Model):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages or ()]


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[StrictInt]


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise UnsupportedParameter(
                "messages", f"tool call arguments are not JSON: {fn['arguments'][:80]!r}"
            ) from None
    return {"id": call.get("id"), "type": "function", "function": fn}


def _structured(fmt: ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise UnsupportedParameter(
            "response_format", "response_format json_schema needs json_schema.schema"
        )
    return StructuredOutputs(json=fmt.json_schema.schema_)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
