"""The hand-offs between the torch-free core and the device side: plain data, no callbacks.

``Scheduler.schedule()`` -> ``SchedulerOutput`` -> runner -> ``RunnerOutput`` ->
``Scheduler.update()`` -> ``TokenEvent``s -> output processor and grammar matchers.

NOTE: read-only by convention, not ``frozen``: a frozen dataclass takes 3-4x longer to build,
and a step builds one ``ScheduledRequest`` and one ``TokenEvent`` per row (about 0.1 ms of
host time per step at batch 64, measured with ``bench/host_overhead.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warmboot.core.request import FinishReason
from warmboot.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One row group of a step: compute ``token_ids`` at positions ``start_pos..``."""

    req_id: str
    token_ids: list[int]
    """Token ids to compute; the last is a placeholder (-1) when ``device_fed``."""
    start_pos: int
    block_table: list[int]
    sample: bool
    """True when this chunk reaches the end of the context: the runner samples one token."""
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    """The request's prompt (penalties); its output history reaches the runner through
    ``TokenEvent``s, never through a shared list."""
    suppress_token_ids: tuple[int, ...] = ()
    device_fed: bool = False
    """The last input token was sampled by the previous, still running step: the runner reads
    it on the device from the request's token slot."""
    prompt_logprobs_from: int = 0
    """Index in ``token_ids`` of the first position whose next-token logprob is wanted."""
    prompt_logprob_targets: tuple[int, ...] = ()
    """The prompt tokens those positions predict (one per position, in order); empty when the
    request asked for no prompt logprobs or has them all."""
    state_load: int | None = None
    """State layers: the checkpoint row this chunk's states start from (``core.state_prefix``);
    None: from the request's own slot (zeros at position 0)."""
    state_saves: tuple[tuple[int, int], ...] = ()
    """State layers: (tokens into this chunk, checkpoint row) to copy the states into there."""
    lora: str | None = None
    """The adapter its rows run with (``Request.lora``); None: the base model."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests finished since the previous step: the runner drops their per-request state."""
    budget_units: float = 0.0
    """The step budget its chunks used (prompt-logprob tokens weigh more): ``StepCost``'s x."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        return all(s.num_tokens == 1 for s in self.scheduled)


@dataclass(slots=True)
class TokenLogprobs:
    token_logprob: float
    top: list[tuple[int, float]]


@dataclass
class RunnerOutput:
    req_ids: list[str]
    """Rows that sampled, in order."""
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Per request: the logprobs of the prompt tokens this step's chunk predicted."""


@dataclass(slots=True)
class TokenEvent:
    """What one step did to one request, for the output processor, the grammar matchers and
    the runner's penalty histories."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    """Set when the step ended the request (a stop token, EOS or the length limit)."""
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Logprobs of the next prompt tokens (in order), when the request asked for them."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
