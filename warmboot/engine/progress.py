"""Start-up progress: every phase is logged as it begins and when it ends (with its seconds),
the thread's listener (``EngineHolder``, for ``/health``) hears the phase under way, and a
phase with a count (bytes of weights read or restored) shows a bar while it runs.

Lines go to the ``warmboot.startup`` logger at INFO (``warmboot serve`` shows them by
default). Bars are drawn only where that logger is on and stderr is a terminal; elsewhere
(a log file, a pipe, a worker's stderr) the two log lines are all a phase prints.

A worker process relays its phases as frames (``launcher.worker``); the launcher replays
them with ``relay``, so they nest under the launcher's own phase (``sandboxed_boot >
worker load_weights``). Torch-free: the launcher imports it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("warmboot.startup")
Advance = Callable[[int], None]


@dataclass(frozen=True)
class PhaseEvent:
    name: str
    seconds: float | None
    """None: the phase begins; else it ended after that long."""
    under_way: str | None
    """The phase under way on this thread after the event (``current()``)."""
    failed: bool = False
    detail: str = ""


Listener = Callable[[PhaseEvent], None]
_local = threading.local()


def _stack() -> list[str]:
    if not hasattr(_local, "stack"):
        _local.stack, _local.listeners = [], []
    return _local.stack


def current() -> str | None:
    """The phase under way on this thread, nested phases joined by " > "."""
    return " > ".join(_stack()) or None


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Call ``listener(event)`` whenever a phase begins or ends on this thread."""
    _stack()
    _local.listeners.append(listener)
    try:
        yield
    finally:
        _local.listeners.remove(listener)


def begin(name: str, detail: str = "") -> None:
    """Phase ``name`` begins on this thread (``phase`` pairs it with ``end``)."""
    _stack().append(name)
    log.info("start-up: %s ...%s", name, f" ({detail})" if detail else "")
    _tell(PhaseEvent(name, None, current(), detail=detail))


def end(name: str, seconds: float, failed: bool = False) -> None:
    """Phase ``name`` ended after ``seconds`` (and any phase begun inside it)."""
    stack = _stack()
    if name in stack:
        del stack[len(stack) - 1 - stack[::-1].index(name) :]
    state = "failed after" if failed else "done in"
    log.info("start-up: %s %s %.2fs", name, state, seconds)
    _tell(PhaseEvent(name, seconds, current(), failed))


def _tell(event: PhaseEvent) -> None:
    for listener in list(_local.listeners):
        try:
            listener(event)
        except Exception:  # noqa: BLE001 - a listener must not break the start-up
            log.debug("phase listener failed", exc_info=True)


@contextmanager
def phase(name: str, total: int | None = None, detail: str = "") -> Iterator[Advance]:
    """Report phase ``name`` while the block runs; yields ``advance(n)``, which moves a bar
    of ``total`` bytes (no bar without ``total``, or where bars are off)."""
    t0 = time.perf_counter()
    detail = detail or (size(total) if total else "")
    begin(name, detail)
    failed = True
    try:
        with _bar(name, total) as advance:
            yield advance
        failed = False
    finally:
        end(name, time.perf_counter() - t0, failed)


def relay(frame: dict, source: str) -> None:
    """Replay a ``phase`` frame (``as_frame``) from ``source`` (a worker) on this thread."""
    label, seconds = f"{source} {frame['name']}", frame.get("seconds")
    if seconds is None:
        begin(label, str(frame.get("detail") or ""))
    else:
        end(label, float(seconds), bool(frame.get("failed")))


def as_frame(event: PhaseEvent) -> dict:
    """The frame a worker sends for ``event`` (``relay`` replays it)."""
    frame = {"t": "phase", "name": event.name, "seconds": event.seconds}
    return frame | {"failed": event.failed, "detail": event.detail}


def size(nbytes: int) -> str:
    """``nbytes`` for a log line: MB below a gigabyte, else GB."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"


def bars_on() -> bool:
    """Bars only where start-up lines show and stderr is a terminal."""
    return log.isEnabledFor(logging.INFO) and sys.stderr.isatty()


@contextmanager
def _bar(name: str, total: int | None) -> Iterator[Advance]:
    if not total or not bars_on():
        yield _ignore
        return
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        desc=name,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()


def _ignore(n: int) -> None:
    pass
