"""The engine in a plain child process (``warmboot serve --engine-process``): the HTTP front end
(uvicorn's event loop, JSON, SSE) and the engine (its host loop and device thread) no longer
share one interpreter, so neither waits on the other's GIL (vLLM splits its API server and
engine core the same way).

The child is the gVisor worker (``launcher.worker``) without a sandbox or an image: the same
frames over stdin/stdout, the same ``RemoteLLM`` in front. It boots its engine as the
in-process path would (tier A from the snapshot store when there is one), so the start path
is the engine's own (cold or restored_image).

Lifetime: the child follows this process. It stops on the ``stop`` frame or at the end of its
stdin; it ignores SIGINT and SIGTERM (a Ctrl-C or a service manager's SIGTERM reach the whole
process group or cgroup: the server drains its requests first, then stops the child); and it
gets SIGKILL when the thread that started it ends (``PR_SET_PDEATHSIG``). That thread waits
for the child, so it lives exactly as long: the child dies with the server, even a killed one.

Placement (``device.threads``): the child's device thread pins its torch threads to the last
cores; with ``place_front`` this process's threads move to the other cores, so the front end
never takes a compute core. The child is started from a thread on all of the engine's CPUs
(``cpus``), so a restart after that move still gets them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from warmboot.device.threads import compute_cpus, default_threads, pin_this_thread, usable_cpus
from warmboot.engine import progress

if TYPE_CHECKING:
    from warmboot.launcher.remote import RemoteLLM

log = logging.getLogger("warmboot.startup")
PARENT_ENV = "WARMBOOT_ENGINE_PARENT"
"""Set for the child: the pid it must die with (``follow_parent``)."""
LOG_LEVEL_ENV = "WARMBOOT_WORKER_LOG_LEVEL"
PR_SET_PDEATHSIG = 1


def start(
    cfg, reason: str, t0: float, fallbacks: tuple[str, ...] = (), place_front: bool = False
) -> RemoteLLM:
    """A started engine process for ``cfg`` (a ``LaunchConfig``): booted and seeded.
    Raises ``WorkerError`` (``WorkerSettingsError``, a ``ValueError``, for settings
    the engine refuses: booting them in-process would fail the same way)."""
    from warmboot.launcher.remote import Channel, LaunchInfo, RemoteLLM

    phases: dict[str, float] = {}
    threads = cfg.engine.get("cpu_threads")
    with _timed(phases, "engine_process_boot"):
        env = _env()
        spare = _take_spare((env, cfg.engine_cpus, threads))
        child = spare or Child(_argv(cfg.engine), env, cfg.engine_cpus, threads)
        try:
            channel = Channel(child.proc.stdin, child.proc.stdout, "engine process")
            if spare is not None:
                channel.send({"t": "boot", "engine": _settings(cfg.engine)})
            from warmboot.tokenizer import Tokenizer  # NOTE: while the child boots

            tokenizer = Tokenizer.from_dir(cfg.engine["model"])
            channel.expect("booted", cfg.boot_timeout)
            # NOTE: no canary: a fresh boot has nothing to check it against (its warm-up ran it)
            channel.send({"t": "start", "seed": cfg.seed, "canary": False})
            started = channel.expect("started", cfg.restore_timeout)
        except BaseException:
            child.reap(timeout=0)
            raise
    ahead = ", started ahead" if spare is not None else ""
    why = f"{reason}; engine process (pid {child.proc.pid}{ahead}): {started['start_reason']}"
    info = LaunchInfo(started["start_path"], why, time.monotonic() - t0, phases, fallbacks)
    client = RemoteLLM(channel, tokenizer, started, info, gone=child.why_gone)
    client.on_exit(child.reap)
    if place_front:
        _place_front(child.compute_cpus)
    log.info("engine process %d ready via %s", child.proc.pid, info.path)
    return client


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """A start-up phase, timed into ``phases`` when it succeeds."""
    t = time.monotonic()
    with progress.phase(name):
        yield
    phases[name] = time.monotonic() - t


class Child:
    """The child process, started and waited for by a thread of its own: the "parent" that
    ``PR_SET_PDEATHSIG`` watches is the thread that forked the child, so it must live as long
    as the child does (and no longer: it ends when the child has gone)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cpus: tuple[int, ...] | None,
        threads: int | None = None,
    ):
        self.compute_cpus: list[int] = []
        """The cores the child's torch threads will be pinned to (the thread policy's)."""
        self._exited = threading.Event()
        spawned: Future = Future()
        args = (argv, env, cpus, threads, spawned)
        name = "warmboot-engine-process"
        threading.Thread(target=self._own, args=args, name=name, daemon=True).start()
        self.proc: subprocess.Popen = spawned.result()

    def _own(self, argv, env, cpus, threads, spawned: Future) -> None:
        try:
            if cpus:  # NOTE: the child inherits this thread's CPUs
                pin_this_thread(list(cpus))
            self.compute_cpus = compute_cpus(threads or default_threads(len(usable_cpus())))
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except BaseException as e:  # noqa: BLE001 - the launcher hears it
            spawned.set_exception(e)
            return
        spawned.set_result(proc)
        proc.wait()
        self._exited.set()

    def why_gone(self) -> str:
        """How the child ended (waiting a little for its exit status)."""
        self._exited.wait(2.0)
        code = self.proc.returncode
        if code is None:
            return f"the engine process (pid {self.proc.pid}) closed its output"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            return f"the engine process (pid {self.proc.pid}) was killed by {name}"
        return f"the engine process (pid {self.proc.pid}) exited with code {code}"

    def reap(self, timeout: float = 10.0) -> None:
        """Wait ``timeout`` s for the child to exit (it was told to stop), then kill it."""
        if not self._exited.wait(timeout):
            log.warning("the engine process did not stop within %.0fs; killing it", timeout)
            self.proc.kill()
            self._exited.wait(10.0)
        try:  # NOTE: its stdout stays with the channel's reader, which has read to the end
            self.proc.stdin.close()
        except OSError:
            pass


def prestart(
    cpus: tuple[int, ...] | None,
    threads: int | None,
    launch: str | None = None,
    store: str | None = None,
) -> None:
    """Start an engine process before its settings are known (``serve``, first thing): it
    imports torch and the engine (1.4-1.9 s from a cold page cache on 2 cores) while this
    process imports its own modules, checks the model and picks the start path. ``start``
    takes it when its environment, CPUs and threads still match; ``drop_spare`` ends it when
    the engine runs elsewhere (a restored sandbox). None is started where a start of
    ``launch`` will run its engine in gVisor (``spare_hints``, which may read ``store``'s
    record: a restore would kill it, held back by it)."""
    from warmboot.launcher import spare_hints

    if spare_hints.expects_gvisor(launch, store):
        return
    env = _env()
    child = Child(_argv(None), env, cpus, threads)
    with _spare_lock:
        _spare.append(((env, cpus, threads), child))


def drop_spare() -> None:
    """Kill a spare engine process that no start took (the engine runs in gVisor)."""
    _take_spare(None)


_spare: list[tuple[tuple, Child]] = []
_spare_lock = threading.Lock()


def _take_spare(match: tuple | None) -> Child | None:
    """The spare engine process started for ``match`` (taken once), else None."""
    with _spare_lock:
        spares, _spare[:] = list(_spare), []
    taken = None
    for made_for, child in spares:
        if taken is None and made_for == match and child.proc.poll() is None:
            taken = child
        else:
            child.proc.kill()  # NOTE: then reaped at once, without the warning of a child
            child.reap()  # that does not stop when told to
    return taken


def _argv(engine: dict | None) -> list[str]:
    # NOTE: -P: a module in the working directory cannot shadow the standard library's
    argv = [sys.executable, "-P", "-m", "warmboot.launcher.worker"]
    return argv if engine is None else [*argv, json.dumps(_settings(engine))]


def _settings(engine: dict) -> dict:
    return {**engine, "model": str(Path(engine["model"]).resolve())}


def _env() -> dict[str, str]:
    """This process's environment, plus the parent to follow and the worker's log level:
    its start-up phases come back as frames and are logged here, so its own lines stay
    quiet unless ``-v``."""
    verbose = logging.getLogger("warmboot").getEffectiveLevel() <= logging.INFO
    level = "INFO" if verbose else "WARNING"
    return {**os.environ, PARENT_ENV: str(os.getpid()), LOG_LEVEL_ENV: level}


def _place_front(compute: list[int]) -> None:
    """Move every thread of this process (and so the threads they start) off ``compute``."""
    front = [c for c in usable_cpus() if c not in compute]
    if not front:
        log.info("engine process: no core left for the front end (the engine uses them all)")
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    moved = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, front)
            moved += 1
        except OSError:  # NOTE: a thread that just ended, or an OS that refuses
            pass
    log.info(
        "front end on cores %s, engine computes on %s (%d threads moved)", front, compute, moved
    )


def follow_parent() -> None:
    """In the worker, first thing: when started by ``start`` (``PARENT_ENV``), die with the
    parent and leave SIGINT and SIGTERM to it. A no-op in a gVisor sandbox."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # NOTE: not Linux: the end of stdin still stops it
        pass
    if os.getppid() != int(parent):  # NOTE: the parent went before the prctl took hold
        os._exit(1)
