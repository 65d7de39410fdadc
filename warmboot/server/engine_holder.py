"""Boots the engine off the event loop and hands out the ``AsyncLLM`` once it is ready.

Until then the server answers ``/health`` with 503 (naming the start-up phase under way) and
every API call with a 503 error, so a load balancer can route around a replica that is still
starting. A boot that fails is final (nothing retries it): ``on_fatal`` hears why, and the
server exits non-zero rather than answering 503 for ever.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelFilesError
from warmboot.engine import progress
from warmboot.engine.client import EngineClient

log = logging.getLogger("warmboot.startup")
USER_ERRORS = (UnsupportedModelError, ModelFilesError, ValueError)
"""Boot failures that need no traceback: the model, its files or the settings are wrong."""


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
        self._since = "since process start, interpreter start-up included"
        if started_at is None:
            self._since = "since the holder was made"
        self.llm: EngineClient | None = None
        self.error: str | None = None
        self.time_to_ready: float | None = None
        """Seconds to ready: from process start for the first boot, else from the restart."""
        self.phase: str | None = None
        """The start-up phase under way (``/health`` names it while starting); None when
        ready. An engine in a worker reports its phases too (``worker load_weights``)."""
        self.restarts = 0
        self.died: str | None = None
        """Why the latest engine died (the holder then booted a new one), or None."""
        self.fatal: str | None = None
        """Why the boot failed (a bad path, an unsupported checkpoint, bad settings, a crash):
        nothing retries it, so the model cannot be served here."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called once with ``fatal`` (the server then exits non-zero)."""
        self.prepare: Callable[[EngineClient], None] | None = None
        """Run on each booted client before it serves (the ``--lora-modules`` adapters are
        read); what it raises fails the boot, as the factory's would."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def ready(cls, engine) -> EngineHolder:
        """A holder around an in-process ``LLMEngine`` that is already booted (tests)."""
        from warmboot.engine.async_llm import AsyncLLM

        holder = cls(lambda: AsyncLLM(engine))
        holder.boot()
        return holder

    def start(self) -> None:
        """Boot in a background thread."""
        self.phase = "launching"
        self._thread = threading.Thread(target=self.boot, name="warmboot-boot", daemon=True)
        self._thread.start()

    def booting(self) -> bool:
        """Whether a background boot is under way."""
        return self._thread is not None and self._thread.is_alive()

    def boot(self) -> None:
        """Boot the engine. With ``freeze_gc`` everything alive once it is ready moves to
        the collector's permanent generation: a full collection over the booted engine's
        ~170k objects stalled every thread for ~70 ms (measured on the demo model)."""
        thawed = self._freeze_gc and gc.get_freeze_count() > 0
        if thawed:
            gc.unfreeze()  # NOTE: a replaced engine's objects must stay collectable
        t0, self.phase = time.monotonic(), self.phase or "launching"
        try:
            with progress.listen(self._on_phase):
                client = self._factory()
        except Exception as e:  # noqa: BLE001 - reported through /health and every API call
            self._failed(e)
            return
        try:
            if self.prepare is not None:
                self.prepare(client)
        except Exception as e:  # noqa: BLE001 - as a failed boot
            _quietly_shut(client)
            self._failed(e)
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._ready(client, time.monotonic() - t0, thawed)
        if closed:  # NOTE: shut down while it booted: it must not outlive the server
            _quietly_shut(client)

    def _on_phase(self, event: progress.PhaseEvent) -> None:
        self.phase = event.under_way or f"after {event.name}"

    def _failed(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {e}"
        user_error = isinstance(e, USER_ERRORS)
        self.fatal = str(e) if user_error else self.error
        if not user_error:
            log.exception("the engine failed to start")
        else:
            log.debug("the boot failed", exc_info=True)
            if self.on_fatal is None:  # NOTE: else the server says it, once, as it exits
                log.error("the model cannot be served: %s", e)
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _ready(self, client: EngineClient, boot_s: float, thawed: bool = False) -> None:
        """Serve ``client`` and say how long the start took: the first from process start
        (interpreter and imports included), a restart from when it began."""
        if self.restarts:
            self.time_to_ready, since = boot_s, f"since restart {self.restarts} began"
        else:
            self.time_to_ready, since = time.monotonic() - self.started_at, self._since
        self.llm, self.phase = client, None
        if self._freeze_gc:  # NOTE: after the old client is dropped: it must not be frozen
            # NOTE: the young generations only (a full collection is the stall freezing
            # avoids, and finds little), but a full one where a replaced engine was thawed:
            # its cycles must not be frozen
            gc.collect(2 if thawed else 1)
            gc.freeze()
        log.info(
            "engine ready after %.1fs (%s): %s", self.time_to_ready, since, self.start_path()[0]
        )

    def require(self) -> EngineClient:
        llm = self.llm
        if llm is not None:
            why = self.check_alive(llm)
            if not why:
                return llm
            raise EngineNotReady(f"the engine stopped ({why}); it is restarting, retry shortly")
        if self.error is not None:
            raise EngineNotReady(f"the engine failed to start: {self.error}")
        raise EngineNotReady("the engine is still starting; retry shortly")

    def check_alive(self, llm: EngineClient | None = None) -> str | None:
        """Why ``llm`` (default: the engine served now) died, after starting its
        replacement; None while it serves. ``/health`` asks too, so an idle replica reports
        a dead engine (and heals) without waiting for a request."""
        llm = self.llm if llm is None else llm
        why = getattr(llm, "dead", None) if llm is not None else None
        if why:
            self._restart(llm, why)
        return why

    def _restart(self, dead: EngineClient, why: str) -> None:
        """Boot a new engine in the background (once per dead one): the replica heals itself
        (restoring from its snapshot when it has one) instead of answering 503 for good."""
        with self._lock:
            if self.llm is not dead:
                return
            log.error("engine died (%s); restarting", why)
            self.llm, self.error, self.died = None, None, why
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

    def abandon(self, code: int) -> None:
        """Exit the process now, leaving the boot under way: its thread cannot be stopped,
        and an interpreter teardown around a thread inside torch's C++ aborts the process (or
        waits a whole compile). Nothing is lost: the engine never served. (A worker sandbox it
        started loses its pipes and exits; the next start sweeps its work directory.)"""
        print(f"exiting during start-up ({self.phase}); the boot is abandoned", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def shutdown(self) -> None:
        """Stop the engine. A boot under way is not waited for (it may be a minute's
        compile): what it brings up is shut down as soon as it is ready."""
        with self._lock:
            first, self._closed, llm = not self._closed, True, self.llm
        if llm is not None:
            llm.shutdown()
        elif first and self.booting():
            log.warning("shutting down during start-up (%s)", self.phase)


def _quietly_shut(client: EngineClient) -> None:
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001 - it is dead already
        log.debug("shutting down a dead engine failed", exc_info=True)


def unservable(model: str, quantization: str | None = None) -> str | None:
    """Why ``model`` cannot be served, found without reading weights (``preflight``)."""
    from warmboot.models.checkpoint import preflight

    try:
        preflight(model, quantization)
    except (UnsupportedModelError, ModelFilesError, ValueError) as e:
        return str(e)
    return None


def process_age() -> float:
    """Seconds since this process started (0 where /proc is unavailable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the comm field
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
