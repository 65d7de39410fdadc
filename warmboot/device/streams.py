"""Device streams and events, one interface for CUDA and the CPU.

- CUDA: torch streams and events; ``submit`` runs the function at once under the stream, which
  only enqueues kernels.
- CPU: one executor thread per stream runs submitted functions in order; an event completes
  when everything submitted before it has run. torch releases the GIL inside ops, so the
  "device" thread computes while the main thread does host work.

Both record device-busy intervals for the bubble meter.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from warmboot.device.helper_arms import HelperArms
from warmboot.device.threads import compute_cpus, host_cpus, pin_this_thread
from warmboot.kernels import native


class Event(Protocol):
    def wait(self) -> None:
        """Block the host until the work recorded before this event has run."""

    def query(self) -> bool: ...


class Stream(Protocol):
    def submit(self, fn: Callable[[], object], tokens: int = 0) -> None:
        """Run ``fn`` in order on the stream; ``tokens``: it is a model step of that many
        tokens (a CPU stream may lend it helper threads, ``lend_helpers``)."""

    def record(self) -> Event: ...

    def busy_seconds(self) -> float:
        """Total time the stream spent running submitted work so far."""

    def lend_helpers(self, count: int, always: bool = False) -> int:
        """Helper threads for the native CPU kernels (CPU only); how many serve."""

    def idle_seconds(self) -> float:
        """How long the stream has had no work (0 while it has some)."""


class _CpuEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("work on the CPU device stream failed") from self.error

    def query(self) -> bool:
        return self._done.is_set()


class CpuStream:
    """An in-order executor thread standing in for a device stream."""

    def __init__(self, threads: int | None = None, name: str = "warmboot-device"):
        self._threads = threads
        self.helpers = 0
        """Helper threads lent to the native kernels (``lend_helpers``)."""
        self.arms: HelperArms | None = None
        """Where helpers are lent step by step: the steps' times lent and solo."""
        self.pinned = False
        """Whether the compute threads are pinned to their cores (``device.threads``)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0.0
        self._running = False
        self._last_end = time.perf_counter()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], tokens: int = 0) -> None:
        self._queue.put(functools.partial(self._step, tokens, fn) if tokens else fn)

    def _step(self, tokens: int, fn: Callable[[], object]) -> None:
        arms = self.arms  # NOTE: read on the device thread, where lend_helpers sets it
        if arms is None:
            fn()
        else:
            arms.run(tokens, fn)

    def record(self) -> _CpuEvent:
        event = _CpuEvent()
        self._queue.put(event)
        return event

    def busy_seconds(self) -> float:
        return self._busy

    def idle_seconds(self) -> float:
        if self._running or not self._queue.empty():
            return 0.0
        return time.perf_counter() - self._last_end

    def lend_helpers(self, count: int, always: bool = False) -> int:
        """Give the device thread's native kernels ``count`` helper threads on the host's
        cores (``kernels.native.use_helpers``), or none (0); returns how many serve. Only a
        one-thread device thread with a host core to spare takes them. Model steps are lent
        them where that has been faster of late (``device.helper_arms``); ``always``: all
        work is, whatever it costs (to measure them)."""
        cpus = host_cpus(self._threads or 1)
        if count and (self._threads != 1 or not cpus):
            count = 0
        lent: list[int] = []

        def lend() -> None:
            lent.append(native.use_helpers(count, cpus))
            if lent[0] and not always:
                self.arms = HelperArms(lent[0], lambda n: native.use_helpers(n, cpus))
            else:
                self.arms = None

        self.submit(lend)
        self.record().wait()
        self.helpers = lent[0]
        return self.helpers

    def close(self, wait: bool = False) -> None:
        """Let the thread exit after the work already submitted; ``wait``: until it has."""
        self._queue.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        if self._threads:
            # NOTE: OpenMP thread counts are per calling thread: set it on the device thread.
            torch.set_num_threads(self._threads)
            self.pinned = pin_this_thread(compute_cpus(self._threads))
        with torch.inference_mode():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                if isinstance(item, _CpuEvent):
                    # NOTE: a failure poisons every later event, so the host sees it on wait().
                    item.error = self._error
                    item._done.set()
                    continue
                if self._error is not None:
                    continue
                t0 = time.perf_counter()
                if self._threads and torch.get_num_threads() != self._threads:
                    # NOTE: the count is process-wide in torch's OpenMP build: a host thread's
                    # torch_threads() (a warm-up, a probe) restores its own on exit
                    torch.set_num_threads(self._threads)
                self._running = True
                try:
                    item()
                except BaseException as e:  # noqa: BLE001 - reported through the next event
                    self._error = e
                self._last_end = time.perf_counter()
                self._running = False
                self._busy += self._last_end - t0


class _CudaEvent:
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class CudaStream:
    """A torch CUDA stream; busy time from pairs of timing events around each submission."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._busy = 0.0
        self._last_end: torch.cuda.Event | None = None
        self._idle_from: float | None = None

    def submit(self, fn: Callable[[], object], tokens: int = 0) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            fn()
            end.record()
        self._intervals.append((start, end))
        self._last_end, self._idle_from = end, None

    def record(self) -> _CudaEvent:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaEvent(event)

    def busy_seconds(self) -> float:
        done = [(s, e) for s, e in self._intervals if e.query()]
        self._intervals = [(s, e) for s, e in self._intervals if not e.query()]
        self._busy += sum(s.elapsed_time(e) for s, e in done) / 1e3
        return self._busy

    def idle_seconds(self) -> float:
        """Counted from when the host first saw the last submission done."""
        if self._last_end is not None and not self._last_end.query():
            self._idle_from = None
            return 0.0
        if self._idle_from is None:
            self._idle_from = time.perf_counter()
        return time.perf_counter() - self._idle_from

    def lend_helpers(self, count: int, always: bool = False) -> int:
        """CPU helper threads: none on a CUDA stream."""
        return 0

    def close(self, wait: bool = False) -> None:
        self.stream.synchronize()


def make_stream(device: torch.device, cpu_threads: int | None = None) -> CpuStream | CudaStream:
    return CudaStream(device) if device.type == "cuda" else CpuStream(cpu_threads)
