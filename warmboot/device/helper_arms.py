"""Whether a CPU step lends the native kernels their helper thread, decided as steps run.

A helper on the host's core gains what that core leaves idle and costs where something else
runs there: offline batch-32 decode on the 2-core Intel VM, +27% with the host's core quiet,
-12% with a busy loop on it (``docs/benchmarks/intel/serve_vllm.md``). Why was not pinned
down (the caller's waits for chunks of a preempted helper came to little): the step time is
what counts, so that is what is measured. A server's host core is busy or idle as its HTTP
front end, clients and host loop come and go, so a choice made once on a quiet machine at
start is wrong part of the time.

So steps are timed lent and solo, per size class (their token count's bit length): after
``WARM`` of each the faster way serves, and one step in ``EXPLORE`` the other, so the choice
follows the load; each way's time is a moving mean of its last few steps. Switching starts or
stops the helper thread (``kernels.native.use_helpers``, tens of microseconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EXPLORE = 16
WARM = 2
WEIGHT = 1 / 8  # NOTE: a moving mean over about the last eight steps of a way


@dataclass
class _Arm:
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [solo, lent]
    seen: list[int] = field(default_factory=lambda: [0, 0])
    steps: int = 0

    def pick(self) -> int:
        """1 to lend the helpers this step, 0 to run solo."""
        self.steps += 1
        if min(self.seen) < WARM:
            return int(self.seen[1] <= self.seen[0])
        best = int(self.seconds[1] < self.seconds[0])
        return 1 - best if self.steps % EXPLORE == 0 else best

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
        arm = self._arms.setdefault(tokens.bit_length(), _Arm())
        lent = arm.pick()
        if lent != self._lent:
            self._lend(self.count * lent)
            self._lent = lent
        t0 = time.perf_counter()
        fn()
        arm.record(lent, time.perf_counter() - t0)

    def means_ms(self) -> dict[int, tuple[float, float]]:
        """Per size class (token count's bit length): the moving mean step, solo and lent."""
        return {k: (a.seconds[0] * 1e3, a.seconds[1] * 1e3) for k, a in self._arms.items()}
