"""Start-up reporting: phases logged as they begin and end, the phase under way in
``EngineHolder.phase`` (a worker's phases relayed under the launcher's), "ready after" counted
from the boot that made the engine ready, and a failed boot reported as fatal."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from warmboot.engine import progress
from warmboot.server.engine_holder import EngineHolder


class _Client:
    start_info = None
    dead = None

    def shutdown(self) -> None:
        pass


def test_phases_are_logged_as_they_begin_and_end(caplog):
    caplog.set_level(logging.INFO, logger="warmboot.startup")
    events = []
    with progress.listen(events.append):
        with progress.phase("load_weights", total=3_000_000) as advance:
            advance(1_000_000)
            assert progress.current() == "load_weights"
        with pytest.raises(RuntimeError), progress.phase("compile"):
            raise RuntimeError("boom")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "start-up: load_weights ... (3.0 MB)"
    assert lines[1].startswith("start-up: load_weights done in ")
    assert lines[2] == "start-up: compile ..."
    assert lines[3].startswith("start-up: compile failed after ")
    assert [(e.name, e.seconds is None, e.under_way) for e in events] == [
        ("load_weights", True, "load_weights"),
        ("load_weights", False, None),
        ("compile", True, "compile"),
        ("compile", False, None),
    ]
    assert events[-1].failed and progress.current() is None


def test_a_workers_phases_nest_under_the_launchers():
    """The worker sends frames (``as_frame``); the launcher replays them (``relay``)."""
    frames = []
    with progress.listen(lambda e: frames.append(progress.as_frame(e))):
        with progress.phase("load_weights", total=2_000_000_000):
            pass
    seen = []
    with progress.listen(lambda e: seen.append(e.under_way)):
        with progress.phase("sandboxed_boot"):
            for frame in frames:
                progress.relay(frame, "worker")
    assert seen == [
        "sandboxed_boot",
        "sandboxed_boot > worker load_weights",
        "sandboxed_boot",
        None,
    ]
    assert frames[0]["detail"] == "2.00 GB"


def test_the_holder_names_the_phase_under_way():
    inside, release = threading.Event(), threading.Event()

    def boot():
        with progress.phase("restore_weights"):
            inside.set()
            release.wait(10)
        return _Client()

    holder = EngineHolder(boot)
    holder.start()
    assert inside.wait(10)
    assert holder.phase == "restore_weights" and holder.booting()
    release.set()
    deadline = time.monotonic() + 10
    while holder.llm is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder.llm is not None and holder.phase is None


def test_ready_after_a_restart_counts_from_the_restart(caplog):
    caplog.set_level(logging.INFO, logger="warmboot.startup")
    holder = EngineHolder(_Client, started_at=time.monotonic() - 500)
    holder.boot()
    assert holder.time_to_ready >= 500
    assert "since process start, interpreter start-up included" in caplog.text
    holder.restarts = 1  # as ``_restart`` counts one, then boots again
    holder.boot()
    assert holder.time_to_ready < 5
    assert "since restart 1 began" in caplog.text


def test_a_failed_boot_is_fatal(caplog):
    heard = []

    def boot():
        raise ValueError("max_model_len=100000 exceeds the model's context (512 positions)")

    holder = EngineHolder(boot)
    holder.on_fatal = heard.append
    holder.boot()
    assert heard == ["max_model_len=100000 exceeds the model's context (512 positions)"]
    assert holder.llm is None and "ValueError" in holder.error

    def crash():
        raise RuntimeError("a bug")

    holder = EngineHolder(crash)
    holder.on_fatal = heard.append
    holder.boot()
    assert heard[-1] == "RuntimeError: a bug"
    assert "Traceback" in caplog.text, "an unexpected failure keeps its traceback"


def test_shutdown_during_the_boot_shuts_the_engine_down_once_booted():
    release, shut = threading.Event(), threading.Event()

    class Client(_Client):
        def shutdown(self) -> None:
            shut.set()

    holder = EngineHolder(lambda: release.wait(10) and Client())
    holder.start()
    holder.shutdown()  # returns at once: the boot is not waited for
    release.set()
    assert shut.wait(10) and holder.llm is None
