"""The versions of the ``runsc`` binaries asked here, so a launch need not ask again
(``runsc --version`` costs about 50 ms of every launch with a store, before the launcher
knows whether it restores). A binary is known by its path, device, inode, size and times: a
replaced or rewritten one is asked again. Best effort: a cache that cannot be read or written
only means asking."""

from __future__ import annotations

import os
from pathlib import Path

KEPT = 8
"""Binaries remembered (the newest)."""


def known(binary: str) -> str | None:
    """The version recorded for ``binary`` as it is now, or None."""
    stamp = _stamp(binary)
    return None if stamp is None else _load().get(stamp)


def remember(binary: str, version: str) -> None:
    """Record ``binary``'s version; the file is replaced whole (a reader never sees half)."""
    from warmboot.config import put_latest

    stamp = _stamp(binary)
    if stamp is not None:
        put_latest(_path(), _load(), stamp, version, KEPT)


def _path() -> Path:
    from warmboot.config import cache_root  # NOTE: here: the sandbox module stays light

    return cache_root() / "runsc_versions.json"


def _stamp(binary: str) -> str | None:
    try:
        real = os.path.realpath(binary)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _load() -> dict[str, str]:
    from warmboot.config import read_cache_dict

    return {k: v for k, v in read_cache_dict(_path()).items() if isinstance(v, str)}
