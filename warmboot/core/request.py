"""The one request object the scheduler tracks. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from warmboot.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    NOTE: lengths are defined once. ``all_token_ids`` = prompt + committed output;
    ``num_inflight`` more tokens are sampled on the device but not yet seen by the host, so the
    context is ``num_tokens`` long. The scheduler advances ``num_computed_tokens`` when it
    schedules a chunk (the KV is written by that step, in stream order); a chunk that reaches
    the end of the context samples one token, which is in flight until the step is committed.
    Preemption resets ``num_computed_tokens`` to 0.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    """Immutable: the scheduled rows share it with the runner (penalties)."""
    params: SamplingParams
    max_tokens: int
    """Resolved output limit: params.max_tokens capped by the context length."""
    eos_token_ids: frozenset[int] = frozenset()
    arrival_index: int = 0
    leader: Request | None = None
    """For n > 1: the sibling whose prompt KV the others wait for and then share."""
    completion_index: int = 0
    group: str | None = None
    """The API call the sequence belongs to (fair scheduling); None: a call of its own."""
    client: str = ""
    """Who sent the call (fair scheduling: clients take turns, then their calls)."""
    prefix_root: bytes | None = None
    """What its KV depends on besides its tokens (``CausalLM.prefix_root``): the root of its
    blocks' prefix-cache chain, so only requests with equal KV share blocks."""
    lora: str | None = None
    """The adapter it runs with (``LoRARequest.lora_name``); None: the base model."""
    rank: int = 0
    """0: its slot is its client's first live one (may take a reserved seat); set by the
    scheduler (``core.fair_queue``)."""
    turn: int = 0
    """Its slot's round, the queue's order after ``priority``; set by the scheduler."""
    local_turn: int = 0
    """Its round among its client's calls; set by the scheduler."""
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the first admission."""
    num_preemptions: int = 0
    served_at: int = 0
    """The scheduler's step count when a step last held it (shared steps serve decodes
    served longest ago first)."""
    num_prompt_logprobs: int = 0
    """Prompt tokens (after the first) whose logprobs a step has been asked for."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (excludes the in-flight ones)."""
        return len(self.all_token_ids)

    @property
    def num_planned_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_inflight

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (the first completion of a group computes them)."""
        return (
            self.params.prompt_logprobs is not None
            and self.completion_index == 0
            and self.num_prompt_logprobs < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        assert self.num_inflight > 0, "committed a token that was never scheduled"
        self.num_inflight -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_after(self, token: int) -> FinishReason | None:
        """Why the sequence ends with ``token`` just committed, or None."""
        p = self.params
        if self.num_output_tokens > p.min_tokens:  # earlier stops were suppressed by the sampler
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                self.stop_reason = token
                return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def suppressed_tokens(self, sample: bool) -> tuple[int, ...]:
        """Stops the sampler must not pick for a row that samples (``min_tokens`` not reached)."""
        if not sample or self.num_planned_outputs >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else tuple(self.eos_token_ids)
        return eos + self.params.stop_token_ids

    def take_prompt_logprob_targets(self, start: int, n: int) -> tuple[int, tuple[int, ...]]:
        """The prompt tokens a chunk at ``start..start+n`` predicts that no earlier step was
        asked for (position ``p`` predicts prompt token ``p + 1``), marked as asked for now:
        (the first one's offset in the chunk, the tokens)."""
        if not self.wants_prompt_logprobs:
            return 0, ()
        first = max(start + 1, self.num_prompt_logprobs + 1)  # the first target token's index
        last = min(start + n, self.num_prompt_tokens - 1)
        if last < first:
            return 0, ()
        self.num_prompt_logprobs = last
        return first - 1 - start, tuple(self.prompt_token_ids[first : last + 1])

    def waits_for_leader(self, prefix_caching: bool) -> bool:
        """n > 1: siblings wait until the leader's first token is committed; by then its
        prompt's full blocks are in the prefix cache and the siblings share them."""
        leader = self.leader
        return (
            prefix_caching
            and leader is not None
            and not leader.is_finished
            and leader.num_output_tokens == 0
        )


def lora_full(running: list[Request], max_loras: int, req: Request) -> bool:
    """``req``'s adapter would be one more than ``max_loras`` among the ``running``."""
    if req.lora is None:
        return False
    live = {r.lora for r in running if r.lora is not None}
    return req.lora not in live and len(live) >= max_loras
