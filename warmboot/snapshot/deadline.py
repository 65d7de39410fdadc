"""Deadlines for store steps: a restore, lookup or publish that stops making progress fails
with ``StoreTimeout`` instead of holding the start-up forever.

The step runs in a daemon thread and reports progress (bytes) through the callback it is
given; the caller waits while progress keeps coming. When none has come for ``stall_s``
(or the step has run ``total_s``), the caller gets ``StoreTimeout`` at once and the step is
abandoned: its next progress report raises, so it stops at its next chunk, and a publish
never writes its manifest after that. A thread stuck inside one blocking call ends when that
call's own timeout fires (the S3 client's connect and read timeouts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from warmboot.snapshot.store_api import StoreError

T = TypeVar("T")
Progress = Callable[[int], None]
POLL_S = 0.05


class StoreTimeout(StoreError):
    """A store step made no progress within its deadline."""


class _Watch:
    def __init__(self, inner: Progress | None):
        self.inner = inner
        self.last = time.monotonic()
        self.abandoned = False

    def progress(self, n: int) -> None:
        if self.abandoned:
            raise StoreTimeout("abandoned after its deadline")
        self.last = time.monotonic()
        if self.inner is not None:
            self.inner(n)


def run_with_deadline(
    what: str,
    step: Callable[[Progress], T],
    stall_s: float,
    total_s: float | None = None,
    progress: Progress | None = None,
) -> T:
    """``step(progress)``'s result, or ``StoreTimeout`` naming ``what`` and the deadline."""
    watch = _Watch(progress)
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = step(watch.progress)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=target, name=f"store-{what[:20]}", daemon=True).start()
    while not done.wait(POLL_S):
        now = time.monotonic()
        if now - watch.last > stall_s or (total_s is not None and now - t0 > total_s):
            watch.abandoned = True
            limit = f"no progress for {stall_s:g} s" if now - watch.last > stall_s else ""
            limit = limit or f"not done after {total_s:g} s"
            raise StoreTimeout(f"{what}: {limit} (deadline; abandoned after {now - t0:.1f} s)")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
