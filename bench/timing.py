"""Timing loops and the statistics the benchmark scripts take of them. Stdlib only."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable


def timed(fn: Callable, *args) -> float:
    """Seconds ``fn(*args)`` takes."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def samples(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn``, after one unmeasured call (the warm-up)."""
    fn()
    return [timed(fn) for _ in range(repeats)]


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` warm calls, in seconds."""
    return min(samples(fn, repeats))


def median_of(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` warm calls, in seconds."""
    return statistics.median(samples(fn, repeats))


def median_record(repeats: int, fn: Callable, *args, key: str = "seconds") -> dict | None:
    """The median (by ``key``) of ``repeats`` records ``fn(*args)`` returns, those that are
    None left out; None if every one was."""
    recs = [r for r in (fn(*args) for _ in range(repeats)) if r]
    return sorted(recs, key=lambda r: r[key])[len(recs) // 2] if recs else None


def rotated(names: list, r: int) -> list:
    """``names`` started at round ``r``'s place, so no engine always runs first."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def interleaved(rounds: int, runs: dict[str, Callable[[], object]]) -> dict[str, list]:
    """``rounds`` rounds, each calling every run once in turn (so drift hits them alike):
    ``{name: [what it returned each round]}``."""
    out: dict[str, list] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            out[name].append(run())
    return out


def median_where(rows: list[dict], key: str, **match) -> float | None:
    """The median of ``key`` over the rows whose items equal ``match``; None if none."""
    vals = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return statistics.median(vals) if vals else None


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q``-th percentile by nearest rank (p99 of fewer than 100 samples: their maximum)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def rounded_rank(values: list[float], q: float) -> float:
    """The value at the rounded rank ``q * (n - 1)`` (``q`` from 0 to 1); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def quantile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, inclusive interpolation; nan for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


# --- what other processes took meanwhile (Linux /proc) --------------------------------------


def busy_ticks() -> int:
    """CPU ticks the whole machine spent busy (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]


def tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and its descendants (children included)."""
    kids: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            kids.setdefault(int(_stat(p)[1]), []).append(int(p))
        except OSError:
            pass
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            total += sum(int(x) for x in _stat(str(p))[11:15])
        except OSError:
            pass
    return total


def _stat(pid: str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def measured(fn):
    """``fn()`` and the cores other processes took while it ran."""
    b0, o0, t0 = busy_ticks(), tree_ticks(os.getpid()), time.monotonic()
    out = fn()
    b1, o1, t1 = busy_ticks(), tree_ticks(os.getpid()), time.monotonic()
    tick = os.sysconf("SC_CLK_TCK")
    return out, max(0, (b1 - b0) - (o1 - o0)) / tick / (t1 - t0)
