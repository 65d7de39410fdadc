"""Short steps while the server is shared (time-capped schedulers, ``max_step_ms``).

A new client's first token waits for the step in flight, whatever its own step costs. Beside
one heavy client, a step capped at ``max_step_ms`` (250 ms by default) or a batch of 62
decodes (70-100 ms on two CPU cores) is that wait: well past twice a quiet request's time plus
one decode step (issue 23's goal). So while more than one client has had a request live within
the last ``RECENT_STEPS`` steps or ``RECENT_S`` seconds, and one of them holds at least half
the running sequences, a step lasts at most ``SHARED_ROW_STEPS`` one-row steps (the fitted
fixed cost plus one decode row; at least ``SHARED_MIN_S``), and the decodes a step holds are
cut to what fits, those served longest ago first: the others take the next step, one token
later. Prefill chunks get what the decodes leave of it, at least ``MIN_UNITS``
(``MIN_PREFILL_UNITS`` where a newcomer waits), not the stretch to twice the step's
unavoidable cost of a client alone.

What it costs: the heavy client's throughput while others come and go (62 decodes in several
steps pay the fixed cost that often); never a client alone (throughput first), nor many alike
clients (none holds half the batch: whole steps). A GPU's decode row costs a fraction of its
fixed cost: there no decode is cut.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from warmboot.core.request import Request

RECENT_STEPS = 32
"""Steps after a client's last live request during which it still counts as present..."""
RECENT_S = 5.0
"""...or seconds, whichever lasts longer: 32 shared steps are 0.7 s on two CPU cores, and a
client back every second or two (a chat, a probe) found the heavy client's capped 250-ms
steps each time (the fairness bench's first probe beside the echo load: 124-162 ms)."""
SHARED_ROW_STEPS = 2.0
"""A shared step's length, in one-row steps (fixed cost plus one decode row): a newcomer
waits for the one in flight, then for its own (three, at least 40 ms, had left the probes
beside the 256-stream load at p99 115 ms against a goal of 105)..."""
SHARED_MIN_S = 0.025
"""...and at least this long: a GPU's one-row step of a few ms would cut prefill chunks to
slivers that pay the fixed cost again and again (on two CPU cores 2 one-row steps are about
27-37 ms compiled and 110 ms eager: two thirds of the 40-55 and 165 ms measured for 3)."""
MIN_UNITS = 16
"""The prefill a shared step always holds beside its decodes (else ``MIN_PREFILL_UNITS``, 32):
a new client's small prompt still fits in one chunk, and an echo request's prompt-logprob
chunk or a sibling's tails over a long prefix no longer make each step 50-80 ms."""

Fit = tuple[float, float, float, float]


class SharedSteps:
    """Which clients were present of late, step by step."""

    def __init__(
        self, running: Sequence[Request] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.running = running
        """The scheduler's running requests (read, never changed here)."""
        self.clock = clock
        self.step = 0
        self._seen: dict[str, tuple[int, float]] = {}
        self.steps = 0
        """Steps scheduled while shared."""

    def note(self, clients: Iterable[str]) -> bool:
        """Count a step with ``clients`` live; whether it is shared: two or more present of
        late, and one of them heavy."""
        self.step, now = self.step + 1, self.clock()
        for c in clients:
            self._seen[c] = (self.step, now)
        if len(self._seen) > 1:
            old, gone = self.step - RECENT_STEPS, now - RECENT_S
            self._seen = {c: (s, t) for c, (s, t) in self._seen.items() if s > old or t > gone}
        shared = len(self._seen) > 1 and self._one_holds_half()
        self.steps += shared
        return shared

    def _one_holds_half(self) -> bool:
        """Whether one client holds at least half the running sequences: a heavy client,
        whose steps are worth cutting for the others. Many alike clients keep whole steps
        (32 clients of one stream each: 540 against 705 tokens/s cut, on two CPU cores)."""
        counts = Counter(r.client for r in self.running if r.group is not None)
        return not self.running or 2 * max(counts.values(), default=0) >= len(self.running)


def shared_seconds(fit: Fit) -> float:
    """A shared step's length: ``SHARED_ROW_STEPS`` one-row steps, at least ``SHARED_MIN_S``."""
    fixed, _, per_row, _ = fit
    return max(SHARED_ROW_STEPS * (fixed + per_row), SHARED_MIN_S)


def shared_cut(
    fit: Fit, running: Sequence[Request], decodes: int, context: int
) -> tuple[float, set[Request], int, int]:
    """A shared step's length, the running decodes it leaves out, and the decode rows and KV
    tokens of those it keeps."""
    seconds = shared_seconds(fit)
    kept = decodes_within(fit, seconds, decodes, context)
    return seconds, served_last(running, decodes - kept), kept, context * kept // max(decodes, 1)


def decodes_within(fit: Fit, seconds: float, decodes: int, context: int) -> int:
    """How many of ``decodes`` decode rows (reading ``context`` KV tokens in all) a step of
    ``seconds`` holds: at least one."""
    if decodes <= 1:
        return decodes
    fixed, _, per_row, per_read = fit
    per = per_row + per_read * context / decodes
    return max(1, min(decodes, int((seconds - fixed) / per + 1e-6)))


def served_last(running: Sequence[Request], n: int) -> set[Request]:
    """The ``n`` running decodes served most recently: a shared step leaves them out."""
    decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
    return set(sorted(decodes, key=lambda r: r.served_at)[len(decodes) - n :]) if n > 0 else set()
