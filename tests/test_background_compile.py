"""A background compile waits for a quiet engine: its tracing holds the interpreter lock, so
it starts once the device stream has had no step for ``QUIET_S`` (at most ``DEFER_MAX_S``)."""

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from warmboot.device.compiled import CompileStats
from warmboot.device.step_choice import StepChoice
from warmboot.device.streams import CpuStream
from warmboot.engine import background_compile
from warmboot.engine.background_compile import ModelCompile


class _Stream:
    """A device stream busy until ``busy_until`` (perf_counter seconds), idle after."""

    def __init__(self, busy_for: float):
        self.busy_until = time.perf_counter() + busy_for

    def idle_seconds(self) -> float:
        return max(0.0, time.perf_counter() - self.busy_until)

    def lend_helpers(self, count):
        return 0


def _start(stream: _Stream) -> tuple[ModelCompile, list[float]]:
    """A background compile of a fake runner; the list gets when its compile began."""
    began: list[float] = []

    def build(kernel):
        began.append(time.perf_counter())
        return SimpleNamespace(linears=None, stats=CompileStats())

    runner = SimpleNamespace(build_compiled=build, install_compiled=lambda s: None, stream=stream)
    job = ModelCompile(lambda name, **kw: contextlib.nullcontext(), 0.0)
    job.start(runner, None, background=True, recorded=StepChoice(mode="eager"))
    return job, began


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(background_compile, "QUIET_S", 0.2)
    monkeypatch.setattr(background_compile, "DEFER_MAX_S", 2.0)


def _join(job: ModelCompile) -> None:
    job.thread.join(10)
    assert not job.thread.is_alive() and job.info["background"], job.info


def test_a_background_compile_waits_for_the_steps_to_stop(quick):
    t0 = time.perf_counter()
    stream = _Stream(busy_for=0.5)
    job, began = _start(stream)
    _join(job)
    assert began[0] - stream.busy_until >= 0.2 - 1e-3, "it began before the engine was quiet"
    assert began[0] - t0 < 1.6, "it waited for the deadline, not for the quiet"


def test_a_background_compile_waits_quiet_from_its_start(quick):
    """A stream idle for long already (the boot's warm-up) still gives a first request that
    is on its way ``QUIET_S``."""
    stream = _Stream(busy_for=-60.0)
    t0 = time.perf_counter()
    job, began = _start(stream)
    _join(job)
    assert 0.2 - 1e-3 <= began[0] - t0 < 1.6


def test_a_busy_engine_still_gets_its_compile(quick):
    t0 = time.perf_counter()
    job, began = _start(_Stream(busy_for=60.0))
    _join(job)
    assert 2.0 - 1e-3 <= began[0] - t0 < 5.0, "the wait is bounded by DEFER_MAX_S"


def test_waiting_for_the_compile_ends_the_deferral(monkeypatch):
    monkeypatch.setattr(background_compile, "DEFER_MAX_S", 60.0)
    t0 = time.perf_counter()
    job, began = _start(_Stream(busy_for=60.0))
    assert job.wait(10)
    assert began and began[0] - t0 < 5.0


def test_a_cpu_stream_is_idle_only_between_its_work():
    stream = CpuStream(threads=1)
    try:
        release = threading.Event()
        stream.submit(lambda: release.wait(10))
        time.sleep(0.1)
        assert stream.idle_seconds() == 0.0, "busy while its work runs"
        release.set()
        stream.record().wait()
        time.sleep(0.1)
        assert 0.1 <= stream.idle_seconds() < 5.0
    finally:
        stream.close(wait=True)
