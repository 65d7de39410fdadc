"""The engine outside gVisor: in a plain child process (``engine_process``) or in this one.

``launch`` comes here when there is no sandbox, no store or no runsc, when a sandboxed boot
failed, and when the recorded costs say a local start is the quicker (``timed``). ``cfg`` is
a ``launch.LaunchConfig``. Light to import: ``serve`` asks ``in_child`` before anything else.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("warmboot.startup")


def start(cfg, reason: str, t0: float, fallbacks: tuple[str, ...] = ()):
    """In a plain child process when ``cfg.engine_process`` says so, else (or when that
    process fails to start) in this one."""
    path_under_way(cfg, sandboxed=False)
    if not in_child(cfg.engine_process, cfg.engine):
        return _in_process(cfg, reason, t0, fallbacks)
    from warmboot.launcher import engine_process

    place = cfg.place_front and not wants_gpu(cfg.engine)
    try:
        return engine_process.start(cfg, reason, t0, fallbacks, place)
    except ValueError:  # NOTE: the settings or model are wrong: in-process would fail alike
        raise
    except Exception as e:  # noqa: BLE001 - the in-process boot is the last resort
        log.warning("the engine process failed to start (%s); booting in-process", e)
        why = f"{reason}; engine process failed: {e}"
        return _in_process(cfg, why, t0, (*fallbacks, "engine_process_failed"))


def path_under_way(cfg, sandboxed: bool) -> None:
    """Tell the launcher's caller that the start path is chosen, and whether the engine runs
    in gVisor (``LaunchConfig.on_path``)."""
    if cfg.on_path is not None:
        cfg.on_path(sandboxed)


def timed(cfg, reason: str, t0: float, key: str, store=None):
    """A local start chosen by recorded cost: its own time is recorded in turn, so a slower
    one sends the next start back to the process image."""
    from warmboot.snapshot import start_costs

    client = start(cfg, reason, t0)
    # NOTE: less what ran before serving only once (a publishing boot's compile, step choice
    # and publish): the next local start restores the image it made
    once = start_costs.one_time(client.stats().get("startup_times", {}))
    start_costs.record_launch(key, "local", max(client.start_info.ready_s - once, 0.0), store)
    recorded(cfg, key, store)
    return client


def recorded(cfg, key: str, store) -> None:
    """Tell the launcher's caller where the next start of ``key`` will run its engine, now
    that this one's cost is on record (``LaunchConfig.on_recorded``): the launcher's own
    choice (``start_costs.local_is_quicker``) on the figures it will read."""
    if cfg.on_recorded is not None:
        from warmboot.snapshot import start_costs

        cfg.on_recorded(start_costs.local_is_quicker(key, store) is None)


def _in_process(cfg, reason: str, t0: float, fallbacks: tuple[str, ...] = ()):
    from warmboot import LLM
    from warmboot.engine.async_llm import AsyncLLM
    from warmboot.launcher.remote import LaunchInfo

    log.info("start-up: the engine runs in this process: %s", reason)
    engine = LLM(**cfg.engine).engine
    info = engine.start_info
    front = AsyncLLM(engine, owns_engine=True)
    front.start_info_override = LaunchInfo(
        info.path,
        f"{reason}; in-process: {info.reason}",
        time.monotonic() - t0,
        info.phase_times,
        fallbacks,
    )
    return front


def in_child(engine_process: str, engine: dict) -> bool:
    """Whether a local start runs the engine in a child process: ``engine_process`` "on", or
    "auto" on the CPU (``LaunchConfig.engine_process``)."""
    return engine_process == "on" or (engine_process == "auto" and not wants_gpu(engine))


def wants_gpu(engine: dict) -> bool:
    """The engine would run on a GPU: asked for, or ``auto`` on a host with an NVIDIA driver.
    (Checked without importing torch.)"""
    device = str(engine.get("device", "auto"))
    if device.startswith("cuda"):
        return True
    return device == "auto" and Path("/proc/driver/nvidia/version").exists()
