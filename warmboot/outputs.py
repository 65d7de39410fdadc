"""What generation returns (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
