"""Boots the engine off the event loop and hands out the ``AsyncLLM`` once it is ready.

Until then the server answers ``/health`` with 503 and every API call with a 503 error, so a
load balancer can route around a replica that is still starting.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from warmboot.config import ModelFilesError
from warmboot.engine.client import EngineClient
from warmboot.models.registry import UnsupportedModelError

log = logging.getLogger("warmboot")


class EngineNotReady(RuntimeError):
    """The engine is still starting, or failed to start."""


class EngineHolder:
    def __init__(
        self,
        factory: Callable[[], EngineClient],
        started_at: float | None = None,
        freeze_gc: bool = False,
    ):
        """``factory`` boots the engine and returns its client (``AsyncLLM`` in-process, or a
        worker's ``RemoteLLM``); ``started_at`` is a ``time.monotonic()`` stamp of process
        start (default: now). ``freeze_gc`` (a server process): see ``boot``."""
        self._factory = factory
        self._freeze_gc = freeze_gc
        self.started_at = time.monotonic() if started_at is None else started_at
        self.llm: EngineClient | None = None
        self.error: str | None = None
        self.time_to_ready: float | None = None
        self.phase: str | None = None
        """The start-up phase under way (``/health`` names it while starting)."""
        self.restarts = 0
        self.fatal: str | None = None
        """Why the model can never be served here (a bad path, an unsupported checkpoint)."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called once with ``fatal`` (the server then exits non-zero)."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def ready(cls, engine) -> EngineHolder:
        """A holder around an in-process ``LLMEngine`` that is already booted (tests)."""
        from warmboot.engine.async_llm import AsyncLLM

        holder = cls(lambda: AsyncLLM(engine))
        holder.boot()
        return holder

    def start(self) -> None:
        """Boot in a background thread."""
        self._thread = threading.Thread(target=self.boot, name="warmboot-boot", daemon=True)
        self._thread.start()

    def boot(self) -> None:
        """Boot the engine. With ``freeze_gc`` everything alive once it is ready moves to
        the collector's permanent generation: a full collection over the booted engine's
        ~170k objects stalled every thread for ~70 ms (measured on the demo model)."""
        if self._freeze_gc:
            gc.unfreeze()  # NOTE: a replaced engine's objects must stay collectable
        try:
            client = self._factory()
        except Exception as e:  # noqa: BLE001 - reported through /health and every API call
            self.error = f"{type(e).__name__}: {e}"
            if isinstance(e, (UnsupportedModelError, ModelFilesError)):
                log.error("the model cannot be served: %s", e)
                self.fatal = str(e)
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)
                return
            log.exception("engine failed to start")
            return
        self.time_to_ready = time.monotonic() - self.started_at
        self.llm = client
        if self._freeze_gc:  # NOTE: after the old client is dropped: it must not be frozen
            gc.collect()
            gc.freeze()
        log.info("engine ready after %.2fs (%s)", self.time_to_ready, self.start_path()[0])

    def require(self) -> EngineClient:
        llm = self.llm
        if llm is not None:
            why = getattr(llm, "dead", None)
            if not why:
                return llm
            self._restart(llm, why)
            raise EngineNotReady(f"the engine stopped ({why}); it is restarting, retry shortly")
        if self.error is not None:
            raise EngineNotReady(f"the engine failed to start: {self.error}")
        raise EngineNotReady("the engine is still starting; retry shortly")

    def _restart(self, dead: EngineClient, why: str) -> None:
        """Boot a new engine in the background (once per dead one): the replica heals itself
        (restoring from its snapshot when it has one) instead of answering 503 for good."""
        with self._lock:
            if self.llm is not dead:
                return
            log.error("engine died (%s); restarting", why)
            self.llm, self.error = None, None
            self.restarts += 1
        threading.Thread(target=_quietly_shut, args=(dead,), daemon=True).start()
        self.start()

    def start_path(self) -> tuple[str, str]:
        """(path, reason): how the engine started. Cold unless the engine says otherwise."""
        info = getattr(self.llm, "start_info", None) if self.llm else None
        if info is None:
            return "cold", "no snapshot store configured"
        return info.path, info.reason

    def state(self) -> dict | None:
        """Engine stats plus start facts for the metrics, or None while not ready."""
        if self.llm is None:
            return None
        path, reason = self.start_path()
        stats = self.llm.stats()
        stats.update(start_path=path, start_reason=reason, time_to_ready_s=self.time_to_ready)
        stats["start_fallbacks"] = tuple(getattr(self.llm.start_info, "fallbacks", ()) or ())
        stats["engine_restarts"] = self.restarts
        return stats

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


def _quietly_shut(client: EngineClient) -> None:
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001 - it is dead already
        log.debug("shutting down a dead engine failed", exc_info=True)


def process_age() -> float:
    """Seconds since this process started (0 where /proc is unavailable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the comm field
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
