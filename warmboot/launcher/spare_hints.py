"""Where the next ``serve`` of a launch will run its engine, so it starts a spare engine
process (``engine_process.prestart``) only where the start may take it.

A spare imports torch and the engine (1.4-1.9 s of a core, and their files read from disk)
while the launcher picks the start path. A tier-P restore kills it unused, and what it took
held the restore back. Demo model, 2-core Intel Xeon, cold page cache, 5 rounds each: tier
P's first token took 2.31-2.53 s beside a spare and 1.91-2.02 s without one, while the eager
cold boot took 1.91-2.03 s with its spare and 1.98-2.03 s without.

So a start that can run its engine in gVisor (a local store, the sandbox allowed, runsc on
the PATH) starts no spare unless its launch's next start is on record as a local one: here,
or for a new replica (an empty cache) in the store's record for its kind of host, where each
start leaves its word too. With none on record it runs there: it restores the key's image,
or boots in gVisor to make one.

A launch is its model (as given), snapshot store and sandbox setting. Every start records
where its engine runs (``LaunchConfig.on_path``), then, once its cost is on record, where
the launcher will run the next start's, by the same figures (``on_recorded``): the launcher
alternates between paths while their costs are a close call, so where the last start ran
was a wrong guess for every other start there. A wrong guess costs one start: a local start
without the overlap (figures another host shared since), or a spare that a restore kills.
Best effort: a file or record that cannot be read means the guess.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

KEPT = 32
"""Launches remembered (the latest)."""
GVISOR, LOCAL = "gvisor", "local"


def launch_id(model: str | None, store: str | None, sandbox: str) -> str | None:
    """The launch's name in the file; None where its engine cannot run in gVisor (no store
    or a remote one, the sandbox off, no runsc: ``launch`` starts it locally)."""
    remote = "://" in str(store) and not str(store).startswith("file://")
    if not store or remote or sandbox == "none" or shutil.which("runsc") is None:
        return None
    blob = json.dumps([model, str(store), sandbox])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def expects_gvisor(launch: str | None, store: str | None = None) -> bool:
    """Whether a start of ``launch`` will run its engine in gVisor: as recorded by its last
    start here, else (a new replica) as hosts of this kind left it in ``store``'s record, and
    yes where none is on record."""
    if launch is None:
        return False
    where = _load().get(launch)
    if where is None and store is not None:
        where = _shared(store).get(launch)
    return where != LOCAL


def remember(launch: str | None, sandboxed: bool, store: str | None = None) -> None:
    """Record where a start of ``launch`` runs its engine, this one's or the next (the file
    is written only when that changed, and replaced whole); with ``store``, in its record for
    this kind of host too, for new replicas (``on_recorded``'s word only)."""
    if launch is None:
        return
    from warmboot.cache_files import put_latest

    where, entries = GVISOR if sandboxed else LOCAL, _load()
    if entries.get(launch) != where:
        put_latest(hints_path(), entries, launch, where, KEPT)
    if store is not None:
        _share(store, launch, where)


def hints_path() -> Path:
    from warmboot.config import cache_root

    return cache_root() / "spare_hints.json"


def _load() -> dict[str, str]:
    from warmboot.cache_files import read_cache_dict

    return {k: v for k, v in read_cache_dict(hints_path()).items() if v in (GVISOR, LOCAL)}


def _record(store: str):
    """(the store, its record's name for this kind of host: ``start_costs.host_class``), or
    None where the store cannot be opened."""
    from warmboot.snapshot.start_costs import host_class
    from warmboot.snapshot.store import open_store

    try:
        return open_store(store), f"spare-hints-{host_class()}"
    except Exception:  # noqa: BLE001 - best effort: the guess
        return None


def _shared(store: str) -> dict[str, str]:
    """The hints in ``store``'s record for this kind of host (``start_costs.read_record``:
    none where it cannot be read)."""
    from warmboot.snapshot.start_costs import read_record

    record = _record(store)
    hints = read_record(*record, "spare hints") if record else {}
    return {k: v for k, v in hints.items() if v in (GVISOR, LOCAL)}


def _share(store: str, launch: str, where: str) -> None:
    from warmboot.cache_files import with_latest
    from warmboot.snapshot.start_costs import write_record

    entries, record = _shared(store), _record(store)
    if record and entries.get(launch) != where:
        write_record(*record, with_latest(entries, launch, where, KEPT), "spare hints")
