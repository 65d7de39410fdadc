"""Small JSON cache files (start costs, spare hints, runsc versions under ``cache_root()``):
read as data, never trusted; written whole."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_cache_dict(path: Path) -> dict:
    """A small JSON cache file's object: empty where the file is missing, unreadable or not
    an object (data, never trusted: callers keep only the values they can use)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache_dict(path: Path, data: dict, indent: int | None = None) -> None:
    """Write ``data`` to ``path`` whole (a temporary file moved over it: a reader never sees
    half); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)


def put_latest(path: Path, entries: dict, key: str, value: object, kept: int) -> None:
    """Write ``with_latest(...)`` whole; best effort: a file that cannot be written stays as
    it was."""
    try:
        write_cache_dict(path, with_latest(entries, key, value, kept))
    except OSError:
        pass


def with_latest(entries: dict, key: str, value: object, kept: int) -> dict:
    """``entries`` with ``key`` set to ``value`` (last), only the latest ``kept`` entries."""
    entries = {k: v for k, v in entries.items() if k != key}
    return dict(list(entries.items())[-(kept - 1) :]) | {key: value}
