"""What the ``runsc`` binaries asked here said, so a launch need not ask again: their version
(``runsc --version`` costs about 50 ms of every launch with a store, before the launcher
knows whether it restores) and their default OCI spec (``runsc spec``, 20-30 ms of every
sandboxed start before ``runsc restore`` runs). A binary is known by its path, device, inode,
size and times: a replaced or rewritten one is asked again. Best effort: a cache that cannot
be read or written only means asking."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

KEPT = 8
"""Binaries remembered (the newest)."""


def known(binary: str, what: str = "version") -> str | None:
    """What ``binary`` as it is now said (``what``: ``version`` or ``spec``), or None."""
    stamp = _stamp(binary)
    return None if stamp is None else _load(what).get(stamp)


def remember(binary: str, answer: str, what: str = "version") -> None:
    """Record what ``binary`` said; the file is replaced whole (a reader never sees half)."""
    from warmboot.cache_files import put_latest

    stamp = _stamp(binary)
    if stamp is not None:
        put_latest(_path(what), _load(what), stamp, answer, KEPT)


def default_spec(binary: str, ask: Callable[[], str]) -> dict:
    """``binary``'s default OCI spec: as recorded, else ``ask()``'s JSON text (recorded). A
    recorded spec without the parts a bundle amends (``process``, ``mounts``) is asked again."""
    try:
        spec = json.loads(known(binary, "spec") or "null")
    except ValueError:
        spec = None
    if isinstance(spec, dict) and isinstance(spec.get("process"), dict):
        if isinstance(spec.get("mounts"), list):
            return spec
    text = ask()
    remember(binary, text, "spec")
    return json.loads(text)


def _path(what: str) -> Path:
    from warmboot.config import cache_root  # NOTE: here: the sandbox module stays light

    return cache_root() / f"runsc_{what}s.json"


def _stamp(binary: str) -> str | None:
    try:
        real = os.path.realpath(binary)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _load(what: str) -> dict[str, str]:
    from warmboot.cache_files import read_cache_dict

    return {k: v for k, v in read_cache_dict(_path(what)).items() if isinstance(v, str)}
