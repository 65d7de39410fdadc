"""Whether a CPU step lends the native kernels their helper thread, decided as steps run.

A helper on the host's core gains what that core leaves idle and costs where something else
runs there: offline batch-32 decode on the 2-core Intel VM, +27% with the host's core quiet,
-12% with a busy loop on it (``docs/benchmarks/intel/serve_vllm.md``). Why was not pinned
down (the caller's waits for chunks of a preempted helper came to little): the step time is
what counts, so that is what is measured. A server's host core is busy or idle as its HTTP
front end, clients and host loop come and go, so a choice made once on a quiet machine at
start is wrong part of the time.

So steps are timed lent and solo, per size class (their token count's bit length): the
faster way serves, and one step in ``EXPLORE`` the other, so the choice follows the load; each
way's time is a moving mean of its last few steps. A size class not yet timed both ways takes
the way its nearest timed class favours (lent where none is: the start's measurement chose
the helpers), and times the other at its first ``EXPLORE``-th step: a rare size, a long
prefill, is not run the slow way half its first steps to learn what the others already show.
Switching starts or stops the helper thread (``kernels.native.use_helpers``, tens of
microseconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EXPLORE = 16
WEIGHT = 1 / 8  # NOTE: a moving mean over about the last eight steps of a way


@dataclass
class _Arm:
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [solo, lent]
    seen: list[int] = field(default_factory=lambda: [0, 0])
    steps: int = 0

    def pick(self, default: int) -> int:
        """1 to lend the helpers this step, 0 to run solo; ``default`` until both ways are
        timed."""
        self.steps += 1
        best = self.best()
        way = default if best is None else best
        return 1 - way if self.steps % EXPLORE == 0 else way

    def best(self) -> int | None:
        """The faster way, or None until both are timed."""
        return None if 0 in self.seen else int(self.seconds[1] < self.seconds[0])

    def record(self, lent: int, seconds: float) -> None:
        mean = self.seconds[lent]
        self.seconds[lent] = mean + (seconds - mean) * WEIGHT if self.seen[lent] else seconds
        self.seen[lent] += 1


class HelperArms:
    """Runs steps on the device thread, each lent ``count`` helpers or not, whichever has been
    faster of late for its size. ``lend(n)`` sets the device thread's helpers to ``n``."""

    def __init__(self, count: int, lend: Callable[[int], int]):
        self.count = count
        self._lend = lend
        self._lent: int | None = None
        self._arms: dict[int, _Arm] = {}

    @property
    def steps(self) -> list[int]:
        """Steps run [solo, lent]."""
        return [sum(a.seen[way] for a in self._arms.values()) for way in (0, 1)]

    def run(self, tokens: int, fn: Callable[[], object]) -> None:
        size = tokens.bit_length()
        arm = self._arms.setdefault(size, _Arm())
        lent = arm.pick(self._default(size))
        if lent != self._lent:
            self._lend(self.count * lent)
            self._lent = lent
        t0 = time.perf_counter()
        fn()
        arm.record(lent, time.perf_counter() - t0)

    def _default(self, size: int) -> int:
        """The way the nearest size class timed both ways favours; lent where none is."""
        timed = [(abs(k - size), k) for k, a in self._arms.items() if a.best() is not None]
        return self._arms[min(timed)[1]].best() if timed else 1

    def means_ms(self) -> dict[int, tuple[float, float]]:
        """Per size class (token count's bit length): the moving mean step, solo and lent."""
        return {k: (a.seconds[0] * 1e3, a.seconds[1] * 1e3) for k, a in self._arms.items()}
