"""Request validation, done once on the way in: tokenize, check the ids and lengths against
the model, and compile any grammar. The result, a ``ValidatedRequest``, is what the engine
queues; a bad request raises ``InvalidRequestError`` naming the problem.

``check`` does all but the compile (a grammar spec is only checked against the size limits
and keyed); ``compile`` / ``compile_async`` then compile on the grammar compile pool, so a
slow grammar never holds a thread that plain requests need. ``validate`` is both, blocking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from warmboot.core.errors import InvalidRequestError
from warmboot.device.grammar_limits import GrammarKey
from warmboot.device.grammar_requests import GrammarRequests
from warmboot.sampling_params import SamplingParams
from warmboot.tokenizer import Tokenizer

Prompt = str | list[int] | dict
SLACK = 2
"""Normalizers may shrink a text (composing accents): the length bound allows for half."""


@dataclass(frozen=True)
class ValidatedRequest:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """``params.max_tokens`` or, when unset, what the context leaves."""
    grammar_key: GrammarKey | None = None
    """The ``structured_outputs`` spec, within the limits, keyed for the compile pool."""
    grammar: object | None = None
    """Its compiled grammar, once compiled (held here: the engine finds it in use)."""

    @property
    def needs_grammar(self) -> bool:
        """A spec still to compile (``RequestValidator.compile`` / ``compile_async``)."""
        return self.grammar_key is not None and self.grammar is None


class RequestValidator:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, grammars: GrammarRequests
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.compiles = grammars.compiles

    def validate(
        self, prompt: Prompt, params: SamplingParams, timeout: float | None = None
    ) -> ValidatedRequest:
        """``check`` then ``compile`` (blocking)."""
        return self.compile(self.check(prompt, params), timeout)

    def compile(self, checked: ValidatedRequest, timeout: float | None = None) -> ValidatedRequest:
        """``checked`` with its grammar compiled (blocking; at most ``timeout`` seconds,
        default ``compiles.timeout_s``); raise ``InvalidRequestError`` if it cannot be."""
        if not checked.needs_grammar:
            return checked
        return replace(checked, grammar=self.compiles.compile(checked.grammar_key, timeout))

    async def compile_async(
        self, checked: ValidatedRequest, timeout: float | None = None
    ) -> ValidatedRequest:
        """``compile`` awaited without holding a thread; cancelling the awaiting task (the
        client left) gives up the compile (see ``GrammarCompiles``)."""
        if not checked.needs_grammar:
            return checked
        compiled = await self.compiles.compile_async(checked.grammar_key, timeout)
        return replace(checked, grammar=compiled)

    def check(self, prompt: Prompt, params: SamplingParams) -> ValidatedRequest:
        """Tokenize and check everything but compiling the grammar (see ``needs_grammar``);
        never waits on the compile pool."""
        text, token_ids = self._tokenize(prompt, params.truncate_prompt_tokens is None)
        token_ids = self._truncate(token_ids, params)
        max_tokens = self._max_tokens(token_ids, params)
        vocab = self.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias tokens", [t for t, _ in params.logit_bias or ()]),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name} {bad} are outside the vocabulary ({vocab})")
        key = None
        if params.structured_outputs is not None:
            key = self.compiles.prepare(params.structured_outputs)
        return ValidatedRequest(text, token_ids, params, max_tokens, key)

    def _tokenize(self, prompt: Prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        """``bounded``: refuse a text too long for the context before tokenizing it (not when
        the prompt is to be truncated)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                return prompt.get("prompt"), self._check_ids(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, self._check_ids(self._encode(prompt, bounded))
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")

    def _encode(self, text: str, bounded: bool = True) -> list[int]:
        """Token ids of ``text``, refusing (when ``bounded``) a text too long for the context
        before paying for its tokenization (bytes bound the token count from below)."""
        limit = self.max_model_len
        if bounded and len(text) > limit:  # NOTE: the bound costs a vocabulary scan, once
            at_least = len(text) // (SLACK * self.tokenizer.max_token_chars)
            if at_least > limit:
                raise InvalidRequestError(
                    f"the prompt has at least {at_least} tokens ({len(text)} characters); "
                    f"max_model_len is {limit}"
                )
        try:
            return self.tokenizer.encode(text)
        except TypeError:  # the tokenizer's word for a str it cannot encode
            raise InvalidRequestError(
                "the prompt is not valid Unicode text (it holds an unpaired surrogate)"
            ) from None

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)")
        vocab = self.vocab_size
        try:  # NOTE: numpy checks a 4k-token prompt in ~0.1 ms; a Python loop took ~3 ms
            arr = np.asarray(ids)
        except (ValueError, TypeError, OverflowError):
            arr = None
        if (
            arr is None
            or arr.ndim != 1
            or arr.dtype.kind not in "iu"
            or not (0 <= arr.min() and arr.max() < vocab)
        ):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return arr.tolist()

    def _truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The last ``truncate_prompt_tokens`` ids (-1: as many as leave room for the output,
        as vLLM does); a larger k than that is refused."""
        k = params.truncate_prompt_tokens
        room = self.max_model_len - (params.max_tokens or 1)
        if k is None or room < 1:
            return token_ids  # NOTE: a max_tokens that leaves no room is refused next
        if k == -1:
            k = room
        if k > room:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={k} exceeds max_model_len ({self.max_model_len}) - "
                f"max_tokens ({params.max_tokens or 1}) = {room}"
            )
        return token_ids[-k:]

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        limit = self.max_model_len
        room = limit - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {limit}, which leaves "
                "no room for output"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={limit}"
            )
        return params.max_tokens or room
