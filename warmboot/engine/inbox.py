"""The engine thread's loop, shared by the asyncio front and the worker process: commands
from other threads wait in an inbox and are applied between steps, so a caller never waits
for a step to finish; when the engine is idle the thread sleeps on the inbox."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from warmboot.outputs import RequestOutput


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, command: Any) -> None:
        """From any thread."""
        self._queue.put(command)

    def serve(
        self,
        engine,
        apply: Callable[[Any], bool],
        deliver: Callable[[list[RequestOutput]], None],
        idle_tick: float | None = None,
    ) -> None:
        """Run on the engine thread until ``apply`` returns False: apply every queued command,
        then one engine step whose outputs go to ``deliver``. ``idle_tick``: while idle,
        ``deliver([])`` that often (the worker reports what changed meanwhile, e.g. a
        background compile that finished)."""
        while True:
            idle = not engine.has_unfinished_requests()
            drained = self._drain(apply, block=idle, timeout=idle_tick)
            if drained is None:
                deliver([])
                continue
            if not drained:
                return
            if engine.has_unfinished_requests():
                deliver(engine.step())

    def _drain(
        self, apply: Callable[[Any], bool], block: bool, timeout: float | None = None
    ) -> bool | None:
        """Apply queued commands; wait for one when ``block`` (None: ``timeout`` passed with
        none). False means stop."""
        while True:
            try:
                command = self._queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return None if block else True
            block = False
            if not apply(command):
                return False
