"""Closing engines at interpreter exit: every engine's start-up (``engine.startup``) is
tracked from its construction until it is closed, and an ``atexit`` hook closes those still
open, so no device thread or background compile is inside torch when the interpreter
finalizes (a thread killed there through a ``noexcept`` frame aborts the process).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger("warmboot.startup")


class Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[Closable] = weakref.WeakSet()


def track(startup: Closable) -> None:
    """Close ``startup`` at exit unless it is closed (``forget``) first."""
    _LIVE.add(startup)


def forget(startup: Closable) -> None:
    _LIVE.discard(startup)


@atexit.register
def _close_all() -> None:
    """Close every live engine's runner at exit."""
    for startup in list(_LIVE):
        try:
            startup.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.debug("closing an engine at exit failed", exc_info=True)
