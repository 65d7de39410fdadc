"""Grammar compiles, isolated from request validation and bounded in size, time and count.

xgrammar compiles a spec in C++ (without the GIL) and cannot be interrupted; one spec takes
from milliseconds to minutes. Measured with the demo model's 49k-token vocabulary on 2 cores:
a 20-property schema 0.01 s, 5000 properties 2.3 s, a 10k-string enum 0.5 s, a 60k-string
enum 12 s (141 MB), 400 nested objects 24 s, ten strings with distinct ``maxLength`` 40 s.
So compiles run here, never on the threads that tokenize and check requests:

- ``prepare`` (``grammar_limits``) refuses a spec over ``GrammarLimits`` up front
  (``GrammarTooLarge``);
- a small pool (``workers`` threads) runs one compile per distinct spec: identical requests
  wait on the same compile, and the backend caches the result (bounded in bytes);
- a caller waits at most its ``timeout``, queued or compiling (``GrammarCompileTimeout``); a
  caller that leaves (timeout, cancelled task or future: the client went) gives up its place.
  A compile nobody waits for is dropped from the queue; one already running finishes in the
  background and its result is cached, while a stand-in worker (at most ``max_abandoned`` at
  once) keeps the queue moving;
- at most ``max_queued`` distinct compiles wait (``GrammarCompileBusy`` beyond).

Threads rather than a killable subprocess: a compile process costs ~330 MB and ~6 s to start
(xgrammar imports torch), and a compiled grammar crosses it as xgrammar's JSON, 0.5 s for a
100-property schema that compiles in 0.03 s, 16 s for the 60k enum; the size limits keep
what a runaway compile can cost to the few spec shapes they cannot see (``maxLength``).
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from warmboot.core.errors import InvalidRequestError
from warmboot.device.grammar_backend import CACHE_BYTES, CompiledGrammar, GrammarBackend, spec_key
from warmboot.device.grammar_limits import GrammarKey, GrammarLimits, prepare
from warmboot.sampling_params import StructuredOutputs

log = logging.getLogger("warmboot")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_LIMITS = GrammarLimits()
EXIT_WAIT_S = 5.0
"""How long interpreter exit waits for running compiles (see ``_close_all``)."""
IDLE_EXIT_S = 30.0
"""An idle pool or deadline thread ends after this long (a dropped engine's service then
goes with it); the next compile starts another."""


class GrammarCompileTimeout(InvalidRequestError):
    """A compile not done within the caller's time limit."""


class GrammarCompileBusy(InvalidRequestError):
    """Too many distinct compiles already waiting."""


class _Job:
    """One distinct spec, queued or compiling, and the tickets waiting for it."""

    __slots__ = ("key", "tickets", "started_at")

    def __init__(self, key: GrammarKey) -> None:
        self.key = key
        self.tickets: set[_Ticket] = set()
        self.started_at: float | None = None


class _Ticket(Future):
    """One caller's wait for a job: its result is the compiled grammar."""

    def __init__(self, job: _Job, limit: float) -> None:
        super().__init__()
        self.job = job
        self.limit = limit
        self.since = time.monotonic()


class GrammarCompiles:
    """The compile service of one ``GrammarBackend`` (created, xgrammar imported, by the
    first compile, on a pool thread)."""

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        limits: GrammarLimits = DEFAULT_LIMITS,
        workers: int | None = None,
        max_abandoned: int | None = None,
        max_queued: int = 64,
    ) -> None:
        """``timeout_s``: the default time limit of a caller's wait. ``workers``: compile
        threads (default ``min(2, cores - 1)``, at least 1); ``max_abandoned``: stand-ins for
        threads busy with compiles nobody waits for (default ``workers``)."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.timeout_s = timeout_s
        self.limits = limits
        self.workers = workers or max(1, min(2, _cores() - 1))
        self.max_abandoned = self.workers if max_abandoned is None else max_abandoned
        self.max_queued = max_queued
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[GrammarKey, _Job] = {}
        """Queued or compiling, by key."""
        self._threads = self._idle = 0
        self._deadlines = _Deadlines(self._expire)
        self._closed = False
        self.counts = dict.fromkeys(("compiled", "failed", "dropped", "timed_out", "hits"), 0)
        _LIVE.add(self)

    # -- API -----------------------------------------------------------------------------------
    @property
    def backend(self) -> GrammarBackend:
        """The backend, created on first use."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def prepare(self, spec: StructuredOutputs) -> GrammarKey:
        """Check ``spec`` against the limits and key it (parses JSON: off the event loop)."""
        return prepare(spec, self.limits)

    def cached(self, spec: StructuredOutputs | GrammarKey) -> CompiledGrammar | None:
        """The compiled grammar if already compiled (cached or in use), never compiling."""
        key = spec if isinstance(spec, tuple) else spec_key(spec)
        backend = self._backend  # NOTE: None until the first compile; never created here
        return None if backend is None else backend.lookup(key)

    def submit(
        self, spec: StructuredOutputs | GrammarKey, timeout: float | None = None
    ) -> Future[CompiledGrammar]:
        """Queue a compile; the future resolves within ``timeout`` seconds (default
        ``timeout_s``) to the compiled grammar or an ``InvalidRequestError``. Cancelling it
        means the caller left. Refusals (limits, queue full) raise here."""
        key = spec if isinstance(spec, tuple) else self.prepare(spec)
        hit = self.cached(key)
        if hit is not None:
            with self._cv:
                self.counts["hits"] += 1
            done: Future[CompiledGrammar] = Future()
            done.set_result(hit)
            return done
        ticket = self._join(key, self.timeout_s if timeout is None else timeout)
        ticket.add_done_callback(self._leave)
        self._deadlines.add(time.monotonic() + ticket.limit, ticket)
        return ticket

    def compile(
        self, spec: StructuredOutputs | GrammarKey, timeout: float | None = None
    ) -> CompiledGrammar:
        """``submit`` and wait (blocking: the sync engine path, the sandbox worker)."""
        return self.submit(spec, timeout).result()

    async def compile_async(
        self, spec: StructuredOutputs | GrammarKey, timeout: float | None = None
    ) -> CompiledGrammar:
        """``submit`` and await, holding no thread; cancelling the awaiting task cancels the
        caller's place. Pass a key from ``prepare`` so nothing is parsed on the event loop."""
        return await asyncio.wrap_future(self.submit(spec, timeout))

    def close(self, wait: float = 0.0) -> bool:
        """Refuse new compiles, fail the queued ones, and wait up to ``wait`` seconds for
        the running ones; True if none is left running (idempotent)."""
        with self._cv:
            self._closed = True
            queued = [t for job in self._queue for t in job.tickets]
            self._queue.clear()
            self._jobs = {k: j for k, j in self._jobs.items() if j.started_at is not None}
            self._cv.notify_all()
        for ticket in queued:
            _settle(ticket, error=GrammarCompileBusy("grammar compiles are shut down"))
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs, wait)

    def stats(self) -> dict:
        """Counts by outcome, the queue and threads, and what the backend's cache holds (bytes,
        grammars: 0 before the first compile) within its byte bound."""
        backend = self._backend
        with self._cv:
            running = [j for j in self._jobs.values() if j.started_at is not None]
            return {
                **self.counts,
                "queued": len(self._queue),
                "running": len(running),
                "abandoned": sum(1 for j in running if not j.tickets),
                "threads": self._threads,
                "cached_bytes": 0 if backend is None else backend.cached_bytes,
                "cached_grammars": 0 if backend is None else backend.cached_grammars,
                "cache_limit_bytes": CACHE_BYTES if backend is None else backend.cache_bytes,
            }

    # -- the queue -----------------------------------------------------------------------------
    def _join(self, key: GrammarKey, limit: float) -> _Ticket:
        """A ticket on the job of ``key``, queuing a new job if there is none."""
        with self._cv:
            job = self._jobs.get(key)
            if job is None:
                if self._closed:
                    raise GrammarCompileBusy("grammar compiles are shut down")
                if len(self._queue) >= self.max_queued:
                    raise GrammarCompileBusy(
                        f"{len(self._queue)} grammars are already waiting to compile (the "
                        f"limit is {self.max_queued}); retry later"
                    )
                job = self._jobs[key] = _Job(key)
                self._queue.append(job)
                self._staff()
            ticket = _Ticket(job, limit)
            job.tickets.add(ticket)
            return ticket

    def _leave(self, ticket: _Ticket) -> None:
        """A ticket is done (result, error, timeout or cancelled): forget it; a job nobody
        waits for leaves the queue, or, compiling, gets a stand-in worker."""
        job = ticket.job
        with self._cv:
            job.tickets.discard(ticket)
            if job.tickets or self._jobs.get(job.key) is not job:
                return
            if job.started_at is None:
                self._queue.remove(job)
                del self._jobs[job.key]
                self.counts["dropped"] += 1
            else:
                self._staff()

    def _expire(self, ticket: _Ticket) -> None:
        """The deadline thread: fail a ticket still waiting at its deadline."""
        if ticket.done():
            return
        limit, started = ticket.limit, ticket.job.started_at
        queued = limit if started is None else max(0.0, started - ticket.since)
        if queued < limit / 2:
            why = f"the grammar took longer than {limit:g} s to compile"
        else:
            why = (
                f"the grammar did not compile within {limit:g} s: the compile queue was busy "
                f"({queued:.1f} s of it waiting for other grammars)"
            )
        with self._cv:
            self.counts["timed_out"] += 1
        _settle(ticket, error=GrammarCompileTimeout(why))

    # -- workers -------------------------------------------------------------------------------
    def _wanted(self) -> int:
        """Threads wanted: ``workers``, plus a stand-in per abandoned compile (bounded)."""
        jobs = self._jobs.values()
        abandoned = sum(1 for j in jobs if j.started_at is not None and not j.tickets)
        return self.workers + min(abandoned, self.max_abandoned)

    def _staff(self) -> None:
        """Under the lock: start threads while jobs wait with no idle thread for them."""
        while self._idle < len(self._queue) and self._threads < self._wanted():
            self._threads += 1
            self._idle += 1
            threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()
        self._cv.notify_all()  # NOTE: a few threads at most; surplus ones wake to retire

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            try:
                result, error = self.backend.compile_key(job.key), None
            except ValueError as e:
                result, error = None, e
            except Exception as e:  # noqa: BLE001 - the callers hear of it
                log.exception("grammar compile failed")
                result, error = None, e
            self._finish(job, result, error)

    def _next_job(self) -> _Job | None:
        """The next queued job, or None when this thread is surplus (it then ends)."""
        with self._cv:
            idle_long = False
            while not self._queue or self._threads > self._wanted():
                if idle_long or self._closed or self._threads > self._wanted():
                    self._threads -= 1
                    self._idle -= 1
                    return None
                idle_long = not self._cv.wait(IDLE_EXIT_S)
            job = self._queue.popleft()
            job.started_at = time.monotonic()
            self._idle -= 1
            return job

    def _finish(self, job: _Job, result: CompiledGrammar | None, error: Exception | None):
        with self._cv:
            del self._jobs[job.key]
            tickets = list(job.tickets)
            self._cv.notify_all()  # NOTE: close() may be waiting
            self._idle += 1
            self.counts["failed" if error else "compiled"] += 1
            self._staff()
        for ticket in tickets:
            if isinstance(error, ValueError):
                _settle(ticket, error=InvalidRequestError(str(error)))
            else:
                _settle(ticket, result, error)


_LIVE: weakref.WeakSet[GrammarCompiles] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """xgrammar aborts the process ("terminate called without an active exception") when
    the interpreter finalizes during a compile: give running compiles ``EXIT_WAIT_S``."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for compiles in list(_LIVE):
        compiles.close(max(0.0, deadline - time.monotonic()))


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (cancelled, timed out)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class _Deadlines:
    """One daemon thread calling ``expire(item)`` when an item's deadline passes (items are
    held weakly: one gone by then needs nothing)."""

    def __init__(self, expire: Callable[[Any], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, when: float, item: Any) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, next(self._seq), weakref.ref(item)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-deadlines")
                self._thread.daemon = True
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._wait_due():
                    self._thread = None
                    return
                item = heapq.heappop(self._heap)[2]()
            if item is not None:
                try:
                    self._expire(item)
                except Exception:  # noqa: BLE001 - the thread must live on
                    log.exception("grammar compile deadline failed")

    def _wait_due(self) -> bool:
        """Under the lock: wait for the earliest deadline; False after ``IDLE_EXIT_S``
        with none."""
        while not self._heap or self._heap[0][0] > time.monotonic():
            if self._heap:
                self._cv.wait(self._heap[0][0] - time.monotonic())
            elif not self._cv.wait(IDLE_EXIT_S) and not self._heap:
                return False
        return True
