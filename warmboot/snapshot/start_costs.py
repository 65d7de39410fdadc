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
``$WARMBOOT_CACHE/start_costs.json`` (the latest ``KEEP`` figures per path and key).
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

A path's cost is the median of its latest ``KEEP`` figures, not the latest one: on a 2-vCPU VM
six demo starts of one path took 2.4 to 3.6 s to serve, so one slow start could send every
later one down a slower path. A close call (medians within ``CLOSE`` of each other) is
measured again until the path it would drop has ``TRIES`` figures: at most two more starts of
that path, whose median was at most ``CLOSE`` slower.

Hosts that share a snapshot store share their figures too: a start with a store keeps them in
the store's record for its kind of host (``host_class``: CPU model and flags, CPU count,
memory), and reads a path's figures from there where this host has none of its own. A new
replica of a serverless fleet has an empty cache: without the store's record every replica
would restore a process image first and try a local start once, whichever had measured
quicker on the replicas before it. The record is data (figures that are no seconds are
dropped, a record past ``MAX_RECORD_BYTES`` or unreadable is none); two hosts writing at once
may lose one figure (the last writer wins), which the next start measures again; a store
that does not answer within ``RECORD_TIMEOUT_S`` shares nothing this start. A sandboxed
worker shares nothing: its figures are gVisor's, not a path the launcher picks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from functools import cache
from pathlib import Path

from warmboot.cache_files import read_cache_dict, write_cache_dict
from warmboot.config import cache_root
from warmboot.host import HOST_NATIVE_ENV, host_cpu_features
from warmboot.snapshot.deadline import run_with_deadline

log = logging.getLogger(__name__)
ENV = "WARMBOOT_START_BY_COST"

OFF_PATH = (
    "compile",
    "compile_artifacts",
    "step_choice",
    "snapshot_publish",
    "autotune",
    "cuda_graphs",
    "native_build",
)
"""Phases that are not between a start and its first servable step."""
KEEP = 5
"""Figures kept per path and key (the latest ones)."""
TRIES = 3
CLOSE = 1.15
"""A path whose median is within this factor of the quicker one's is tried again while it
has fewer than ``TRIES`` figures."""
RECORD_TIMEOUT_S = 5.0
"""How long a start waits for the store's record (read or written) before it goes on without."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("", "0")


def costs_path() -> Path:
    return cache_root() / "start_costs.json"


def cost(times: dict[str, float]) -> float:
    return sum(v for k, v in times.items() if k not in OFF_PATH)


def one_time(times: dict[str, float]) -> float:
    """Seconds of the off-path phases in ``times`` (names bare or ``worker.``-prefixed)."""
    return sum(v for k, v in times.items() if k.rsplit(".", 1)[-1] in OFF_PATH)


def record(key: str, path: str, times: dict[str, float], store=None) -> None:
    """Keep this start's cost (``path``: ``cold`` or ``restored_image``) under ``key``, here
    and in ``store``'s record for this kind of host (a ``Store``; None: here only)."""
    _save(key, path, cost(times), store)


def _save(key: str, path: str, seconds: float, store=None) -> None:
    if not enabled():
        return
    here = _read_local()
    _add(here, key, path, seconds)
    try:
        write_cache_dict(costs_path(), here, indent=1)
    except OSError as e:
        log.warning("start costs not recorded: %s", e)
    if (name := _record_name(store)) is not None:
        shared = _read_shared(store, name)
        _add(shared, key, path, seconds)
        write_record(store, name, shared, "start costs")


def _add(costs: dict, key: str, path: str, seconds: float) -> None:
    figures = costs.setdefault(key, {}).setdefault(path, [])
    figures.append(round(seconds, 4))
    del figures[:-KEEP]


def cold_is_quicker(key: str, explore: bool = False, store=None) -> str | None:
    """Why a cold start beats restoring ``key`` here, or None (restore). ``explore``: with a
    restore on record and no cold start, a cold start is tried once, to measure it (where a
    cold start is cheap to try: on the CPU its compile runs in the background), and again
    while it is a close call."""
    entry = _load(store).get(key, {}) if enabled() else {}
    figures = entry.get("restored_image"), entry.get("cold")
    once, compare = "the restore took {r:.2f}s", "{o:.2f}s to serve against {r:.2f}s restored"
    return _why(*figures, explore, "a cold start", once, compare)


def record_launch(key: str, path: str, seconds: float, store=None) -> None:
    """Keep a launch's seconds to serving (``restored_process`` or ``local``) under the
    process key."""
    _save(f"process:{key}", path, seconds, store)


def local_is_quicker(key: str, store=None) -> str | None:
    """Why a start outside gVisor beats restoring the process image ``key`` here, or None."""
    entry = _load(store).get(f"process:{key}", {}) if enabled() else {}
    figures = entry.get("restored_process"), entry.get("local")
    once = "the process image's restore took {r:.2f}s"
    compare = "{o:.2f}s against {r:.2f}s for the process image"
    return _why(*figures, True, "a start outside gVisor", once, compare)


def _why(restored, other, explore: bool, what: str, once: str, compare: str) -> str | None:
    """Why to take the ``other`` path over the restore, by the paths' median figures (lists
    of seconds or None), or None (restore): ``what`` tried once (no figure of its own yet;
    where ``explore``), tried again (a close call it has too few figures for; where
    ``explore``) or measured quicker (unless it is a close call the restore has too few
    figures for). ``once`` and ``compare`` are formatted with the medians ``r`` and ``o``."""
    if restored is None:
        return None
    r = statistics.median(restored)
    if other is None:
        return f"{what} tried once, to measure it ({once.format(r=r)})" if explore else None
    o = statistics.median(other)
    if o < r and not (len(restored) < TRIES and r <= CLOSE * o):
        return f"{what} measured quicker here ({compare.format(r=r, o=o)})"
    if r <= o and explore and len(other) < TRIES and o <= CLOSE * r:
        return f"{what} tried again, a close call ({compare.format(r=r, o=o)})"
    return None


def _load(store=None) -> dict[str, dict[str, list[float]]]:
    """Every key's figures per path: this host's, else those in ``store``'s record."""
    costs = _read_local()
    name = _record_name(store)
    for key, entry in (_read_shared(store, name) if name else {}).items():
        mine = costs.setdefault(key, {})
        mine |= {p: f for p, f in entry.items() if p not in mine}
    return costs


def _read_local() -> dict[str, dict[str, list[float]]]:
    return _valid(read_cache_dict(costs_path()))


def _read_shared(store, name: str) -> dict[str, dict[str, list[float]]]:
    return _valid(read_record(store, name, "start costs"))


def read_record(store, name: str, what: str) -> dict:
    """``store``'s JSON record ``name`` (a ``Store``), under ``RECORD_TIMEOUT_S``; empty where
    there is none, it is no JSON object or the store does not answer (data, never trusted:
    the caller checks its values)."""
    try:
        raw = run_with_deadline(what, lambda _: store.get_record(name), RECORD_TIMEOUT_S)
        data = json.loads(raw or b"{}")
    except Exception as e:  # noqa: BLE001 - unreadable, stalled or no JSON: nothing shared
        log.info("no %s read from %s: %s", what, store.url, e)
        return {}
    return data if isinstance(data, dict) else {}


def write_record(store, name: str, data: dict, what: str) -> None:
    """Replace ``store``'s record ``name`` with ``data``, under ``RECORD_TIMEOUT_S``; best
    effort (a read-only or stalled store keeps what it had)."""
    blob = json.dumps(data, indent=1).encode()
    try:
        run_with_deadline(what, lambda _: store.put_record(name, blob), RECORD_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a read-only or stalled store: kept here
        log.info("%s not shared through %s: %s", what, store.url, e)


def _valid(data: dict) -> dict[str, dict[str, list[float]]]:
    costs = {}
    for key, entry in data.items():
        if isinstance(key, str) and isinstance(entry, dict):
            costs[key] = {p: f for p, v in entry.items() if (f := _figures(v))}
    return costs


def _record_name(store) -> str | None:
    """The store's record for this kind of host, or None: no store, or a sandboxed worker
    (the launcher hands it the host's native library: ``HOST_NATIVE_ENV``)."""
    if store is None or os.environ.get(HOST_NATIVE_ENV):
        return None
    return f"start-costs-{host_class()}"


@cache
def host_class() -> str:
    """This kind of host, as far as a start's cost goes: CPU model and flags, CPU count and
    memory in GiB (a digest; the machine's, not this process's affinity, which ``serve``
    narrows for its front end once the engine runs)."""
    cpus = os.cpu_count()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 30
    except (ValueError, OSError):
        memory = 0
    what = f"{host_cpu_features()} | {cpus} cpus | {memory} GiB"
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _figures(value: object) -> list[float]:
    """A path's recorded seconds (data, never trusted): a list of numbers, or one number as
    files written before the median was kept have."""
    values = value if isinstance(value, list) else [value]
    ok = [float(v) for v in values if type(v) in (int, float) and v >= 0]
    return ok[-KEEP:]
