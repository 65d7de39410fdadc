"""The two engine loops over the same scheduler, runner and sampler.

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
from typing import TYPE_CHECKING

from warmboot.engine.runner import StepHandle

if TYPE_CHECKING:
    from warmboot.engine.llm_engine import LLMEngine


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


class SyncLoop:
    name = "sync"

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def in_flight(self) -> bool:
        return False

    def step(self) -> set[str]:
        eng = self.engine
        handle = eng.launch(eng.scheduler.schedule())
        eng.runner.submit_forward(handle)
        eng.launch_sample(handle)
        return eng.commit(handle)


class PipelinedLoop:
    name = "pipelined"

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.sampled: StepHandle | None = None
        """Step t: forward and sample enqueued, not yet committed."""
        self.forwarded: StepHandle | None = None
        """Step t+1: forward enqueued, sample not yet."""

    def in_flight(self) -> bool:
        return any(h is not None and h.inputs is not None for h in (self.sampled, self.forwarded))

    def step(self) -> set[str]:
        eng = self.engine
        if self.sampled is None:  # pipeline empty: start it with steps t and t+1
            self.sampled = eng.launch(eng.scheduler.schedule())
            eng.runner.submit_forward(self.sampled)
            eng.launch_sample(self.sampled)
            self.forwarded = eng.launch(eng.scheduler.schedule())
            eng.runner.submit_forward(self.forwarded)
        touched = eng.commit(self.sampled)
        if self.forwarded.inputs is None and not eng.scheduler.has_unfinished():
            eng.launch_sample(self.forwarded)  # nothing left: retire the empty step, go idle
            eng.commit(self.forwarded)
            self.sampled = self.forwarded = None
            eng.meter.reset_clock()
            return touched
        eng.launch_sample(self.forwarded)  # as soon as commit(t) allows: masks, penalties
        upcoming = eng.launch(eng.scheduler.schedule())  # host work while sample(t+1) runs
        eng.runner.submit_forward(upcoming)
        self.sampled, self.forwarded = self.forwarded, upcoming
        return touched
