"""What generation returns (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Logprob:
    logprob: float
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop', 'length' or 'abort'; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, if any."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per output token: {token id: Logprob} for the top-n and the sampled token."""
    delta_text: str = ""
    """Streaming: text added since the previous output of this request."""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt token {token id: Logprob} for the
    top-n and the prompt token (None for the first token). "delta" outputs carry it once."""


class OutputFolder:
    """Folds the ``delta`` outputs of one request into the cumulative one.

    ``add`` costs O(new tokens); ``cumulative`` builds the whole output, O(length), so a
    consumer that needs only the end pays for it once.
    """

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[dict[int, Logprob]] | None] = {}
        self._last: dict[int, CompletionOutput] = {}
        self._out: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is None and self._out is not None:
            out = replace(out, prompt_logprobs=self._out.prompt_logprobs)
        self._out = out
        for c in out.outputs:
            i = c.index
            self._text.setdefault(i, []).append(c.delta_text)
            self._ids.setdefault(i, []).extend(c.delta_token_ids)
            if c.logprobs is not None:
                new = c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :]
                self._logprobs.setdefault(i, []).extend(new)
            self._last[i] = c

    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self._ids.values())

    def cumulative(self) -> RequestOutput:
        """The whole output so far; its delta fields are those of the latest output."""
        if self._out is None:
            raise ValueError("no output to fold yet")
        outputs = []
        for i in sorted(self._last):
            last = self._last[i]
            text = "".join(self._text[i])
            self._text[i] = [text]
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(self._ids[i]),
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    logprobs=list(lp) if (lp := self._logprobs.get(i)) is not None else None,
                    delta_text=last.delta_text,
                    delta_token_ids=list(last.delta_token_ids),
                )
            )
        return replace(self._out, outputs=outputs)
