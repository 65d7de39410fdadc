"""OpenAI request models (pydantic) and their translation into ``SamplingParams``.

Every field of OpenAI's request schemas and of vLLM's documented extras has an explicit
treatment, listed in the README's request-field table: honoured; accepted and ignored by design
(``IgnoredByDesign``: they do not change the output, e.g. ``user``, ``metadata``, ``store``); or a 400
naming it when set to anything but its default (``_refused``). A field no schema knows is a
400 naming it, as OpenAI answers, so a client never silently gets something other than it
asked for.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, StrictInt

from warmboot.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from warmboot.server.fields import (
    ChatMessage,
    IgnoredByDesign,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsParams,
    UnsupportedParameter,
    _Strict,
    _structured,
    choice_grammar,
)

MAX_STOP_SEQUENCES = 16
MAX_COMPLETIONS_LOGPROBS = 5


class _SamplingRequest(IgnoredByDesign):
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
    """Ignored by design (``IgnoredByDesign``): a latency hint."""
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
