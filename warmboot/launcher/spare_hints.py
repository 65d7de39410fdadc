"""Where the last ``serve`` of a launch ran its engine, so the next one starts a spare engine
process (``engine_process.prestart``) only where a start may take it.

A spare imports torch and the engine (1.4-1.9 s of a core, and their files read from disk)
while the launcher picks the start path. A tier-P restore kills it unused, and what it took
held the restore back. Demo model, 2-core Intel Xeon, cold page cache, 5 rounds each: tier
P's first token took 2.31-2.53 s beside a spare and 1.91-2.02 s without one, while the eager
cold boot took 1.91-2.03 s with its spare and 1.98-2.03 s without.

So a launch whose last start ran its engine in gVisor starts no spare. A launch is its model
(as given), snapshot store and sandbox setting; every start records where its engine ran
(``LaunchConfig.on_path``). A wrong guess costs one start: a local start without the overlap,
or a spare that a restore kills. Best effort: a file that cannot be read or written means a
spare, as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

KEPT = 32
"""Launches remembered (the latest)."""
GVISOR, LOCAL = "gvisor", "local"


def launch_id(model: str | None, store: str | None, sandbox: str) -> str | None:
    """The launch's name in the file; None where its engine never runs in gVisor."""
    if not store or sandbox == "none":
        return None
    blob = json.dumps([model, str(store), sandbox])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sandboxed_last(launch: str | None) -> bool:
    """Whether the last start of ``launch`` ran its engine in gVisor."""
    return launch is not None and _load().get(launch) == GVISOR


def remember(launch: str | None, sandboxed: bool) -> None:
    """Record where this start of ``launch`` runs its engine (the file is written only when
    that changed, and replaced whole)."""
    if launch is None:
        return
    from warmboot.config import write_cache_dict

    where = GVISOR if sandboxed else LOCAL
    entries = _load()
    if entries.get(launch) == where:
        return
    entries.pop(launch, None)
    entries = dict(list(entries.items())[-(KEPT - 1) :]) | {launch: where}
    try:
        write_cache_dict(_path(), entries)
    except OSError:
        pass


def _path() -> Path:
    from warmboot.config import cache_root

    return cache_root() / "spare_hints.json"


def _load() -> dict[str, str]:
    from warmboot.config import read_cache_dict

    return {k: v for k, v in read_cache_dict(_path()).items() if v in (GVISOR, LOCAL)}
