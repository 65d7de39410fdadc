"""The start-up's ``compile`` phase: trace and compile the model steps (``device.compiled``),
in the foreground, or on a background thread (a restore; a cold start of unsaid mode) while
the engine serves eager steps; then the ``step_choice`` phase picks the step that serves
(compiled with one GEMM or another, or eager) and the engine switches to it.

A restored snapshot that carries inductor's artifacts loads them first (the
``compile_artifacts`` phase), so the compile only re-traces.

A background compile waits for a quiet engine before each of its phases (no step for
``QUIET_S``, at most ``DEFER_MAX_S`` in all): its tracing holds the interpreter lock, which
made the first requests after a start wait for their eager steps (a restored 1.5B model's
first token came 1-2 s later than an eager cold boot's).

The background compile runs on a non-daemon thread, so the interpreter waits for it at exit:
a daemon thread still inside torch's C++ when the interpreter finalizes is killed through a
``noexcept`` frame and the process aborts ("terminate called without an active exception",
exit 134).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

from warmboot.device import step_choice
from warmboot.device.runner import ModelRunner
from warmboot.device.step_choice import StepChoice
from warmboot.engine import progress

log = logging.getLogger("warmboot.startup")
QUIET_S = 0.5
"""A background compile's phase starts once the engine has run no step for this long (nor
since the compile began: a first request may be on its way as the engine turns ready)..."""
DEFER_MAX_S = 10.0
"""...or once it has waited this long in all, so a busy engine still gets compiled steps."""
Phase = Callable[..., AbstractContextManager[progress.Advance]]
"""``Startup.phase``: times a phase into the start-up's times and reports it."""


class ModelCompile:
    """One engine's compile of its model steps, redone whenever the weights change."""

    def __init__(self, phase: Phase, t0: float):
        self.phase = phase
        self.t0 = t0
        """When the start-up began (``info["ready_s"]`` counts from it)."""
        self.info: dict[str, Any] = {"compiled": False}
        """What the compile did: graphs traced, inductor seconds, cache hits/misses."""
        self.thread: threading.Thread | None = None
        """A restore's background compile."""
        self._hurry = threading.Event()
        """Set by ``wait``: a background compile stops waiting for a quiet engine."""

    def start(
        self,
        runner: ModelRunner,
        artifacts: Callable[[], str] | None,
        background: bool,
        recorded: StepChoice | None = None,
        allow_eager: bool = True,
    ) -> None:
        """Compile ``runner``'s steps, first loading a restored image's compile ``artifacts``
        (which returns a note on them) so inductor's caches hit. ``background``: on a thread,
        so no request waits for the trace. ``recorded``: a snapshot's step choice, applied
        as it is; otherwise one is measured (``device.step_choice``, between serving steps
        in the background), eager among the candidates where ``allow_eager``."""
        self.wait()
        self.info = {"compiled": False, "state": "compiling"}
        self.thread = None
        self._hurry.clear()
        if not background:
            self._run(runner, artifacts, recorded, allow_eager)
            return
        # NOTE: not a daemon: the interpreter must wait for it at exit (see the docstring)
        self.thread = threading.Thread(
            target=self._run,
            args=(runner, artifacts, recorded, allow_eager),
            name="warmboot-compile",
        )
        self.thread.start()

    def _run(
        self,
        runner: ModelRunner,
        artifacts: Callable[[], str] | None,
        recorded: StepChoice | None = None,
        allow_eager: bool = True,
    ) -> None:
        note = "cold boot: compiled here"
        detail = "in the background: eager steps serve meanwhile" if self.thread else ""
        quiet = self._quiet_waiter(runner)
        try:
            if artifacts is not None:
                quiet()
                with self.phase("compile_artifacts", detail=detail):
                    note = artifacts()
            quiet()
            with self.phase("compile", detail=detail):
                steps = runner.build_compiled(recorded.kernel if recorded else "native")
            choice = recorded
            if choice is None:
                quiet()
                with self.phase("step_choice", detail=detail):
                    choice = step_choice.choose(runner, steps, allow_eager)
            if steps.linears is not None:
                steps.linears.set_dense_rows(choice.dense_rows)
            runner.install_compiled(steps if choice.mode == "compiled" else None)
            runner.stream.lend_helpers(choice.helpers)
            stats = steps.stats
        except Exception as e:  # noqa: BLE001 - eager steps go on serving
            if self.thread is None:
                raise
            self.info = {"compiled": False, "state": f"failed: {_describe(e)}"}
            if not threading.main_thread().is_alive():  # NOTE: torch refuses work at exit
                log.debug("the background compile ended with the interpreter: %s", e)
                return
            log.error("compiling the model steps failed, serving eagerly: %s", _describe(e))
            return
        ready = time.perf_counter() - self.t0
        self.info = {"compiled": choice.mode == "compiled", **asdict(stats), "artifacts": note}
        self.info["step_choice"] = choice.as_fact()
        self.info |= {"background": self.thread is not None, "ready_s": ready}
        if self.thread is not None:
            keep_heap_frozen()
        log.info(
            "model steps compiled: %d graphs, %.1fs in inductor, cache %d hits / %d misses (%s)",
            stats.graphs,
            stats.seconds,
            stats.cache_hits,
            stats.cache_misses,
            note,
        )

    def _quiet_waiter(self, runner: ModelRunner) -> Callable[[], None]:
        """On the background thread: a call that returns once ``runner``'s stream has been
        idle for ``QUIET_S`` (counted from the compile's start at the earliest), or once the
        calls together have waited ``DEFER_MAX_S``, or at ``wait``."""
        if self.thread is None:
            return lambda: None
        began = time.perf_counter()
        deadline = began + DEFER_MAX_S

        def quiet() -> None:
            while not self._hurry.is_set() and time.perf_counter() < deadline:
                idle = min(runner.stream.idle_seconds(), time.perf_counter() - began)
                if idle >= QUIET_S:
                    return
                self._hurry.wait(QUIET_S - idle)

        return quiet

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; True when the compiled steps run (or none)."""
        self._hurry.set()
        if self.thread is not None:
            self.thread.join(timeout)
        return not self.thread or not self.thread.is_alive()


def keep_heap_frozen() -> None:
    """Where the process froze its booted heap (the server and the engine process do, see
    ``EngineHolder``), move what a background compile left alive there too, once: dynamo's
    and inductor's ~250k objects otherwise make each full collection stall every thread for
    100-150 ms on two CPU cores (the demo model; an echo request's output building set them
    off mid-load). A process that froze nothing (an offline ``LLM``) is left as it is."""
    if gc.get_freeze_count():
        gc.collect()
        gc.freeze()


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
