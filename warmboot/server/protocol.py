"""OpenAI request models (pydantic) and their translation into ``SamplingParams``.

Every field of OpenAI's request schemas and of vLLM's documented extras has an explicit
treatment, listed in the README's request-field table: honoured; accepted and ignored by design
(``IGNORED``: they do not change the output, e.g. ``user``, ``metadata``, ``store``); or a 400
naming it when set to anything but its default (``_refused``). A field no schema knows is a
400 naming it, as OpenAI answers, so a client never silently gets something other than it
asked for.
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
    """Nested objects: unknown keys are ignored (clients send back assistant messages with
    response-only keys such as ``refusal``, ``annotations`` or ``reasoning_content``)."""

    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request body or an option object: an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    _refused: dict[str, str] = {}
    """Fields accepted only at their default: name -> why anything else is refused."""

    def check_refused(self) -> None:
        for name, why in self._refused.items():
            value = getattr(self, name)
            if value != type(self).model_fields[name].default and value not in _UNSET:
                raise UnsupportedParameter(name, f"{name} is not supported: {why}")


_UNSET = (None, False, [], {})

IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key", "prompt_cache_retention", "prediction")  # fmt: skip
"""Accepted and ignored by design: identification, billing and storage hints, and OpenAI's
predicted outputs (a latency hint); none changes the output. (Prefix caching is automatic.)"""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: usage in every chunk."""
    include_obfuscation: bool | None = None
    """OpenAI's padding against length side channels: ignored by design (loopback or TLS)."""


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object, structural_tag."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_fallback: bool = False
    """Honoured trivially: warmboot has one grammar backend and never falls back."""
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    _refused = {
        "disable_any_whitespace": "xgrammar's JSON grammars here allow JSON whitespace",
        "disable_additional_properties": "give additionalProperties: false in the schema",
        "whitespace_pattern": "xgrammar has no whitespace pattern",
    }

    def spec(self) -> StructuredOutputs:
        self.check_refused()
        given = {k: v for k, v in self._forms().items() if v not in (None, False)}
        if len(given) != 1:
            raise UnsupportedParameter(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag (got {sorted(given) or 'none'})",
            )
        ((kind, value),) = given.items()
        if kind == "choice":
            return StructuredOutputs(grammar=choice_grammar(value, "structured_outputs"))
        return StructuredOutputs(**{kind: value})

    def _forms(self) -> dict[str, Any]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice,
                "grammar": self.grammar, "json_object": self.json_object,
                "structural_tag": self.structural_tag}  # fmt: skip


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar admitting exactly one of ``choices`` (JSON string literals are valid
    EBNF literals)."""
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise UnsupportedParameter(param, "choice needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class JsonSchema(_Strict):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _SamplingRequest(_Strict):
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
    logit_bias: dict[str, float] | None = None
    # ignored by design (IGNORED)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int = 0
    return_tokens_as_token_ids: bool = False
    request_id: Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's, refused unless at their default
    use_beam_search: bool = False
    length_penalty: float = 1.0
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    return_token_ids: bool = False
    prompt_embeds: Any = None

    _refused = {
        "use_beam_search": "warmboot samples; it has no beam search",
        "length_penalty": "it applies to beam search only",
        "bad_words": "use logit_bias",
        "logits_processors": "custom logits processors are not supported",
        "cache_salt": "the prefix cache is shared by every request to this server",
        "kv_transfer_params": "warmboot has no disaggregated prefill",
        "vllm_xargs": "there are no extension arguments",
        "return_token_ids": "ask for logprobs, or /tokenize the text",
        "prompt_embeds": "prompts are text or token ids",
        "guided_whitespace_pattern": "xgrammar has no whitespace pattern",
    }

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
        self.check_refused()
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise UnsupportedParameter(
                "guided_decoding_backend",
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: "
                "warmboot's structured outputs run on xgrammar",
            )

    def structured(self, response_format: ResponseFormat | None) -> StructuredOutputs | None:
        """The one output constraint asked for, by OpenAI's ``response_format``, vLLM's
        ``structured_outputs`` or its older ``guided_*`` fields; two of them are a 400."""
        forms = {"response_format": _structured(response_format)}
        if self.structured_outputs is not None:
            forms["structured_outputs"] = self.structured_outputs.spec()
        for kind in ("json", "regex", "grammar"):
            if (value := getattr(self, f"guided_{kind}")) is not None:
                forms[f"guided_{kind}"] = StructuredOutputs(**{kind: value})
        if self.guided_choice is not None:
            grammar = choice_grammar(self.guided_choice, "guided_choice")
            forms["guided_choice"] = StructuredOutputs(grammar=grammar)
        given = {k: v for k, v in forms.items() if v}
        if len(given) > 1:
            names = sorted(given)
            raise UnsupportedParameter(names[1], f"{' and '.join(names)} cannot be combined")
        return next(iter(given.values()), None)

    def _params(self, max_tokens: int | None, logprobs: int | None, structured) -> SamplingParams:
        extras = {
            k: v
            for k, v in {
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "prompt_logprobs": self._prompt_logprobs(),
                "truncate_prompt_tokens": self.truncate_prompt_tokens,
                "allowed_token_ids": self.allowed_token_ids,
            }.items()
            if v is not None
        }
        # NOTE: engine fields passed only when set, so their defaults stay the engine's
        for name in ("spaces_between_special_tokens", "include_stop_str_in_output", "priority"):
            if getattr(self, name) != type(self).model_fields[name].default:
                extras[name] = getattr(self, name)
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
            skip_special_tokens=self.skip_special_tokens,
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

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    """0 (with ``echo``): score the prompt, generate nothing."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETIONS_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    add_special_tokens: bool = True
    """vLLM's: whether a text prompt is tokenized with the tokenizer's special tokens (BOS)."""

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
        return self._params(max_tokens, self.logprobs, self.structured(self.response_format))

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


class _ChatRendering(_Strict):
    """How chat messages become the prompt (``chat_render``): vLLM's fields."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    """Passed to a chat template that reads ``reasoning_effort`` (GPT-OSS's); else a 400."""

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def check_rendering(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedParameter(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true",
            )


class ChatCompletionRequest(_SamplingRequest, _ChatRendering):
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    """Ignored by design (``IGNORED``)."""
    # refused unless at their default
    echo: bool = False
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    _refused = _SamplingRequest._refused.default | {
        "echo": "use continue_final_message to extend the last message",
        "audio": "warmboot serves text models",
        "functions": "use tools (functions is deprecated)",
        "function_call": "use tool_choice (function_call is deprecated)",
        "verbosity": "the served model has no verbosity setting",
        "web_search_options": "warmboot has no web search",
        "mm_processor_kwargs": "warmboot serves text models",
    }

    def sampling_params(self, tool_tag: dict | None = None) -> SamplingParams:
        """``tool_tag``: the structural tag that enforces this request's tool calls."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs requires logprobs=true")
        if self.modalities not in (None, ["text"]):
            raise UnsupportedParameter("modalities", "only the text modality is served")
        self.check_rendering()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        structured = self.structured(self.response_format)
        if tool_tag is not None:
            if structured is not None:
                raise UnsupportedParameter(
                    "response_format", "response_format and tool calls cannot be combined"
                )
            structured = StructuredOutputs(structural_tag=tool_tag)
        return self._params(max_tokens, logprobs, structured)


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered as a chat request would be."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (their template holds any BOS)."""
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None

    def chat(self) -> _ChatRendering:
        """The rendering half of the equivalent chat request."""
        fields = self.model_dump(exclude={"model", "prompt", "return_token_strs", "tools"})
        fields["add_special_tokens"] = bool(self.add_special_tokens)
        chat = _ChatRendering.model_validate(fields)
        chat.check_rendering()
        return chat


class DetokenizeRequest(_Strict):
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
