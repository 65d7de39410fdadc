"""Per-request sampling parameters (vLLM-shaped), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

MAX_LOGPROBS = 20
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
MAX_LOGIT_BIAS = 100.0
OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output to a JSON schema, any JSON object, a regex or an EBNF grammar.

    Exactly one of the fields must be set.
    """

    json: dict | str | None = None
    """A JSON schema (a dict or its JSON text)."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
    regex: str | None = None
    grammar: str | None = None
    """An EBNF grammar in the GBNF dialect, with a ``root`` rule."""
    structural_tag: dict | str | None = None
    """An xgrammar structural tag (a dict or its JSON text): free text and tagged regions,
    each constrained (how tool calls are enforced)."""

    def __post_init__(self) -> None:
        chosen = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            self.grammar is not None,
            self.structural_tag is not None,
        ]
        if sum(chosen) != 1:
            raise ValueError(
                "invalid sampling parameter structured_outputs: set exactly one of json, "
                "json_object, regex, grammar, structural_tag"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    """Number of completions for the prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    repetition_penalty: float = 1.0
    """HF-style: logits of tokens in prompt or output are divided (>0) / multiplied (<0)."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtracted once from logits of tokens already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtracted per occurrence in the output."""
    max_tokens: int | None = 16
    """None means up to the model's context length."""
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first one found (after it with
    ``include_stop_str_in_output``)."""
    include_stop_str_in_output: bool = False
    """vLLM: keep the stop string that ended the output in its text (cut right after it), and
    detokenize a stop token id / EOS that ended it like any token (an EOS that
    ``skip_special_tokens`` skips still adds nothing). Nothing is held back while streaming."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return this many top log-probabilities per output token (plus the sampled one's)."""
    prompt_logprobs: int | None = None
    """Return this many top log-probabilities per prompt token (plus the prompt token's own),
    computed in the prefill; the first prompt token has none. Such a request does not start
    from a cached prefix (a cached block's logits are not kept)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """vLLM (fast tokenizers): with ``skip_special_tokens=False``, False writes an added token
    that directly follows another added token as its bare content, without the separator the
    tokenizer's decoder puts between tokens (WordPiece-style decoders join with spaces). A
    byte-level, Metaspace or SentencePiece-style decoder adds no such separator: no effect."""
    structured_outputs: StructuredOutputs | None = None
    """Grammar-constrained decoding; the output ends when the grammar is complete."""
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    """OpenAI-style: added to these tokens' logits before penalties and sampling, each in
    [-100, 100] (-100 bans a token, +100 all but forces it). Stored as sorted (id, bias) pairs;
    logprobs stay those of the raw model."""
    truncate_prompt_tokens: int | None = None
    """vLLM: keep only the last k prompt tokens (left truncation) before running; -1 keeps
    as many as the context leaves beside ``max_tokens`` (beside one token when it is None).
    A k above that is refused. Outputs report the kept prompt token ids."""
    priority: int = 0
    """vLLM priority scheduling: lower values are served first (ties in arrival order), and
    a preemption for KV memory takes a lowest-priority request. All 0: plain FCFS."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM: only these token ids may be sampled (a hard mask applied before sampling; the
    logprobs stay those of the raw model)."""
    output_kind: str = "cumulative"
    """What each streamed output holds: "cumulative" (the whole text and tokens so far, plus
    the delta fields), "delta" (only what is new: O(new tokens) per output, for streaming) or
    "final" (one output, at the end). ``LLM.generate`` always returns final outputs."""

    def __post_init__(self) -> None:
        # NOTE: frozen dataclass; normalise list inputs to tuples through object.__setattr__.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.allowed_token_ids, (list, set, frozenset, range)):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else (bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)) or None)
        self._validate()

    def _validate(self) -> None:
        self._validate_numbers()
        self._validate_stops_and_bias()
        self._validate_options()

    def _bad(self, name: str, why: str) -> NoReturn:
        raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

    def _validate_numbers(self) -> None:
        """Counts, sampling knobs, penalties, lengths and logprobs."""
        bad = self._bad
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")

    def _validate_stops_and_bias(self) -> None:
        """Stop strings and token ids, the seed, and the logit bias pairs."""
        bad = self._bad
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        for token, value in self.logit_bias or ():
            if not isinstance(token, int) or token < 0:
                bad("logit_bias", f"token {token!r} is not a non-negative integer id")
            if (
                not isinstance(value, (int, float))
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
            ):
                bad("logit_bias", f"bias {value!r} of token {token} is outside [-100, 100]")

    def _validate_options(self) -> None:
        """Output and detokenizing flags, prompt truncation, priority, allowed token ids."""
        bad = self._bad
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        for name in ("include_stop_str_in_output", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        k = self.truncate_prompt_tokens
        if k is not None and (type(k) is not int or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, -1 (the context) or None")
        if type(self.priority) is not int:
            bad("priority", "must be an integer")
        allowed = self.allowed_token_ids
        if allowed is not None and not isinstance(allowed, tuple):
            bad("allowed_token_ids", "must be a list of token ids or None")
        if allowed is not None and not allowed:
            bad("allowed_token_ids", "must not be empty (None allows every token)")
        if any(type(t) is not int or t < 0 for t in allowed or ()):
            bad("allowed_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
