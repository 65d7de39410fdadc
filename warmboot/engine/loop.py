"""The two engine loops over the same parts (scheduler, runner, grammar matchers, output
processor). A loop owns the step: launch, sample, commit.

sync:       plan(t) -> forward(t) -> sample(t) -> wait -> commit(t)
pipelined:  wait(t) -> commit(t) -> sample(t+1) -> plan(t+2) -> forward(t+2)
            The device runs forward(t+1) while the host commits t; sample(t+1) is enqueued
            right after commit(t) ("forward now, sample later"), so penalty histories and
            grammar masks see token t, and t+2 is planned while it runs. A request that ends
            at t is finalized at once; its row in t+1 is a zombie whose blocks and slot are
            held until t+1 retires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from warmboot.core.block_manager import BlockManager
from warmboot.core.output_processor import OutputProcessor
from warmboot.core.request import FinishReason
from warmboot.core.scheduler import Scheduler
from warmboot.core.step_cost import StepCost
from warmboot.core.types import SchedulerOutput
from warmboot.device.grammar_requests import GrammarRequests
from warmboot.device.runner import ModelRunner
from warmboot.device.staging import StepHandle


@dataclass
class BubbleMeter:
    """Device-busy vs wall time between consecutive commits of decode-only steps."""

    wall: float = 0.0
    busy: float = 0.0
    steps: int = 0
    launched_rows: int = 0
    _last: tuple[float, float] | None = field(default=None, repr=False)

    def mark(self, busy_now: float, decode_only: bool) -> None:
        now = time.perf_counter()
        if self._last is not None and decode_only:
            self.wall += now - self._last[0]
            self.busy += busy_now - self._last[1]
            self.steps += 1
        self._last = (now, busy_now)

    def reset_clock(self) -> None:
        """The engine went idle: the gap until the next request is not a bubble."""
        self._last = None

    @property
    def bubble_fraction(self) -> float | None:
        if not self.wall:
            return None
        return max(0.0, 1.0 - self.busy / self.wall)


@dataclass
class StepParts:
    """What a loop is built from."""

    scheduler: Scheduler
    block_manager: BlockManager
    runner: ModelRunner
    grammars: GrammarRequests
    outputs: OutputProcessor


class Loop:
    """Launch, sample and commit one step; the two loops order these calls."""

    name = ""

    def __init__(self, parts: StepParts):
        self.parts = parts
        self.meter = BubbleMeter()
        self._busy = 0.0
        self._began: float | None = None
        """The sync loop: when the step in commit was planned (its wall time is its cost)."""

    def in_flight(self) -> bool:
        return False

    def step(self) -> set[str]:
        """Commit one step; return the ids of the request groups it advanced."""
        raise NotImplementedError

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Build the step's inputs and enqueue its forward; the step holds its sequences'
        blocks until it retires (zombies)."""
        p = self.parts
        handle = p.runner.prepare_step(sched)
        handle.held_seqs = [s.req_id for s in sched.scheduled]
        p.block_manager.hold_seqs(handle.held_seqs)
        self.meter.launched_rows += len(sched.scheduled)
        p.runner.submit_forward(handle)
        return handle

    def sample(self, handle: StepHandle) -> None:
        """Enqueue the step's sampling with the masks of the matchers as committed now."""
        self.parts.runner.launch_sample(handle, self.parts.grammars.bitmask(handle.sample_rows))

    def commit(self, handle: StepHandle) -> set[str]:
        """Wait for a step, apply its tokens, finalize stopped requests, retire the step."""
        p = self.parts
        result = p.runner.collect(handle)
        touched: set[str] = set()
        if handle.inputs is not None:
            events = p.scheduler.update(handle.sched, result)
            p.runner.record_tokens(events)
            ended = p.grammars.accept(events)
            touched, stopped = p.outputs.process(events)
            p.scheduler.finish_requests(stopped + ended, FinishReason.STOP)
        p.block_manager.unhold_seqs(handle.held_seqs)
        decode_only = handle.sched.decode_only and bool(touched)
        busy = p.runner.stream.busy_seconds()
        if handle.inputs is not None:  # NOTE: device time since the last commit: this step's
            seconds = busy - self._busy
            if self._began is not None:  # NOTE: sync: the host's part holds the step as long
                seconds = max(seconds, time.perf_counter() - self._began)
            _observe(p.scheduler.step_cost, handle.sched, seconds)
        self._busy = busy
        self.meter.mark(busy, decode_only)
        return touched


def _observe(cost: StepCost, sched: SchedulerOutput, seconds: float) -> None:
    """Feed a retired step's shape and cost in seconds to the step-cost fit."""
    units = rows = pairs = logprobs = 0
    for s in sched.scheduled:  # NOTE: one pass: this runs every step
        n = s.num_tokens
        pairs += n * s.start_pos + n * (n + 1) // 2  # NOTE: a decode row: its context
        logprobs += len(s.prompt_logprob_targets)
        if n == 1:
            rows += 1
        else:
            units += n
    cost.observe(units, rows, pairs, seconds, logprobs)


class SyncLoop(Loop):
    name = "sync"

    def step(self) -> set[str]:
        self._began = time.perf_counter()
        handle = self.launch(self.parts.scheduler.schedule())
        self.sample(handle)
        return self.commit(handle)


class PipelinedLoop(Loop):
    name = "pipelined"

    def __init__(self, parts: StepParts):
        super().__init__(parts)
        self.sampled: StepHandle | None = None
        """Step t: forward and sample enqueued, not yet committed."""
        self.forwarded: StepHandle | None = None
        """Step t+1: forward enqueued, sample not yet."""

    def in_flight(self) -> bool:
        return any(h is not None and h.inputs is not None for h in (self.sampled, self.forwarded))

    def step(self) -> set[str]:
        scheduler = self.parts.scheduler
        if self.sampled is None:  # pipeline empty: start it with steps t and t+1
            self.sampled = self.launch(scheduler.schedule())
            self.sample(self.sampled)
            self.forwarded = self.launch(scheduler.schedule())
        touched = self.commit(self.sampled)
        if self.forwarded.inputs is None and not scheduler.has_unfinished():
            self.sample(self.forwarded)  # nothing left: retire the empty step, go idle
            self.commit(self.forwarded)
            self.sampled = self.forwarded = None
            self.meter.reset_clock()
            return touched
        self.sample(self.forwarded)  # as soon as commit(t) allows: masks, penalties
        upcoming = self.launch(scheduler.schedule())  # host work while sample(t+1) runs
        self.sampled, self.forwarded = self.forwarded, upcoming
        return touched


def make_loop(parts: StepParts, pipelined: bool) -> Loop:
    return PipelinedLoop(parts) if pipelined else SyncLoop(parts)
