"""Where the last ``serve`` of a launch ran its engine, so the next one starts a spare engine
process (``engine_process.prestart``) only where a start may take it.

A spare imports torch and the engine (1.4-1.9 s of a core, and their files read from disk)
while the launcher picks the start path. A tier-P restore kills it unused, and what it took
held the restore back. Demo model, 2-core Intel Xeon, cold page cache, 5 rounds each: tier
P's first token took 2.31-2.53 s beside a spare and 1.91-2.02 s without one, while the eager
cold boot took 1.91-2.03 s with its spare and 1.98-2.03 s without.

So a start that can run its engine in gVisor (a local store, the sandbox allowed, runsc on
the PATH) starts no spare unless its launch's next start is on record as a local one. With
none on record it runs there: it restores the key's image, or boots in gVisor to make one.
A launch is its model (as given), snapshot store and sandbox setting. Every start records
where its engine runs (``LaunchConfig.on_path``), then, once its cost is on record, where
the launcher will run the next start's, by the same figures (``on_recorded``): the launcher
alternates between paths while their costs are a close call, so where the last start ran
was a wrong guess for every other start there. A wrong guess costs one start: a local start
without the overlap (a new replica where a local start is the quicker, or figures another
host shared since), or a spare that a restore kills. Best effort: a file that cannot be
read means the guess.
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


def expects_gvisor(launch: str | None) -> bool:
    """Whether a start of ``launch`` will run its engine in gVisor: as recorded by its last
    start, and yes where none is on record."""
    return launch is not None and _load().get(launch, GVISOR) == GVISOR


def remember(launch: str | None, sandboxed: bool) -> None:
    """Record where a start of ``launch`` runs its engine, this one's or the next (the file
    is written only when that changed, and replaced whole)."""
    if launch is None:
        return
    from warmboot.config import put_latest

    where, entries = GVISOR if sandboxed else LOCAL, _load()
    if entries.get(launch) != where:
        put_latest(hints_path(), entries, launch, where, KEPT)


def hints_path() -> Path:
    from warmboot.config import cache_root

    return cache_root() / "spare_hints.json"


def _load() -> dict[str, str]:
    from warmboot.config import read_cache_dict

    return {k: v for k, v in read_cache_dict(hints_path()).items() if v in (GVISOR, LOCAL)}
