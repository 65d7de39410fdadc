"""What each start path cost on this machine, per snapshot key, so a start takes the quicker.

A tier-A restore skips loading and transforming the checkpoint but adds a lookup, hashing
the chunks as they stream and the canary; on a small model a cold start can be quicker (the
issue measured 5.7 s restored against 2.8 s cold, eager). So every start records its cost
here, and a start whose key has both costs on record restores only if the restore was the
quicker; otherwise it boots cold, says why (``start_info.reason``) and publishes nothing.
Where only a restore is on record (the key's image was made in gVisor, whose cost file is its
own, or on another host), a CPU engine tries a cold start once, as the launcher does below.

The cost of a start is its phases up to the first step it can serve: what runs in the
background or only for publishing (``compile``, ``step_choice``, ``snapshot_publish``,
``autotune``, ``cuda_graphs``, ``native_build``: a publisher's wait for the native library's
first build) is left out, so a publishing cold boot and a quick one count alike. Kept in
``$WARMBOOT_CACHE/start_costs.json`` (the latest figure per path and key).
``$WARMBOOT_START_BY_COST=0`` restores whenever it can and records nothing (the test suite's
default: its restore tests want the restore).

The launcher does the same one level up, per process key (``process:<key>``): its seconds
from launch to a serving engine for a tier-P restore (``restored_process``) and for a start
outside gVisor (``local``: an engine process or this one, itself cold or tier A). Where the
local figure is lower, the launcher skips tier P (``local_is_quicker``). Once a restore is on
record and no local start yet, the next start is a local one, tried once, and the measured
figures decide from then on: a bounded loss, once per key and host. (Nothing measured in the
sandbox stands in for it: the engine's own boot in the worker that made a 1.5B model's image
took 64 s, through gVisor's file I/O, against 8 s for a whole local start.)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from warmboot.config import cache_root, read_cache_dict, write_cache_dict

log = logging.getLogger(__name__)
ENV = "WARMBOOT_START_BY_COST"

OFF_PATH = ("compile", "compile_artifacts", "step_choice", "snapshot_publish", "autotune",
            "cuda_graphs", "native_build")  # fmt: skip
"""Phases that are not between a start and its first servable step."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("", "0")


def costs_path() -> Path:
    return cache_root() / "start_costs.json"


def cost(times: dict[str, float]) -> float:
    return sum(v for k, v in times.items() if k not in OFF_PATH)


def one_time(times: dict[str, float]) -> float:
    """Seconds of the off-path phases in ``times`` (names bare or ``worker.``-prefixed)."""
    return sum(v for k, v in times.items() if k.rsplit(".", 1)[-1] in OFF_PATH)


def record(key: str, path: str, times: dict[str, float]) -> None:
    """Keep this start's cost (``path``: ``cold`` or ``restored_image``) under ``key``."""
    _save(key, path, cost(times))


def _save(key: str, path: str, seconds: float) -> None:
    if not enabled():
        return
    costs = _load()
    costs.setdefault(key, {})[path] = round(seconds, 4)
    try:
        write_cache_dict(costs_path(), costs, indent=1)
    except OSError as e:
        log.warning("start costs not recorded: %s", e)


def cold_is_quicker(key: str, explore: bool = False) -> str | None:
    """Why a cold start beats restoring ``key`` here, or None (restore). ``explore``: with a
    restore on record and no cold start, a cold start is tried once, to measure it (where a
    cold start is cheap to try: on the CPU its compile runs in the background)."""
    entry = _load().get(key, {}) if enabled() else {}
    cold, restored = entry.get("cold"), entry.get("restored_image")
    if restored is not None and cold is None and explore:
        return f"a cold start tried once, to measure it (the restore took {restored:.2f}s)"
    if cold is None or restored is None or restored <= cold:
        return None
    return f"a cold start measured quicker here ({cold:.2f}s to serve against {restored:.2f}s restored)"


def record_launch(key: str, path: str, seconds: float) -> None:
    """Keep a launch's seconds to serving (``restored_process`` or ``local``) under the
    process key."""
    _save(f"process:{key}", path, seconds)


def local_is_quicker(key: str) -> str | None:
    """Why a start outside gVisor beats restoring the process image ``key`` here, or None."""
    entry = _load().get(f"process:{key}", {}) if enabled() else {}
    restored = entry.get("restored_process")
    local = entry.get("local")
    if restored is None:
        return None
    if local is None:
        return f"a start outside gVisor tried once, to measure it (the process image's restore took {restored:.2f}s)"
    if local >= restored:
        return None
    return f"a start outside gVisor measured quicker here ({local:.2f}s against {restored:.2f}s for the process image)"


def _load() -> dict:
    return {
        k: {p: v for p, v in e.items() if isinstance(v, (int, float))}
        for k, e in read_cache_dict(costs_path()).items()
        if isinstance(e, dict)
    }
