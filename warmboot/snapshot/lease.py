"""Publish leases: one publisher per key across every server sharing a store.

A lease is a small JSON object in the store (``leases/<name>.lease``) created only if absent
(a hard link locally, a conditional PUT on S3). It names its holder and when it expires; an
expired lease, or one whose holder process on this host is gone (killed mid-publish), is
taken over. Two servers that find the same expired lease at once may both take it, which
costs a duplicated publish, never a wrong snapshot (publishing stays idempotent: the same
chunks, either complete manifest wins).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from warmboot.config import pid_alive
from warmboot.snapshot.image import IntegrityError
from warmboot.snapshot.store_api import KEY_RE, Store

PUBLISH_LEASE_S = 900.0


@dataclass(frozen=True)
class Lease:
    store: Store
    name: str
    token: str

    def release(self) -> None:
        """Drop the lease if it is still ours (an expired one may have been taken over)."""
        held = _holder(_read(self.store, self.name))
        if held is not None and held.get("token") == self.token:
            self.store.delete_lease(self.name)


def try_lease(store: Store, name: str, ttl_s: float = PUBLISH_LEASE_S) -> Lease | None:
    """The lease ``name`` for ``ttl_s`` seconds, or None while another holder's is fresh."""
    if not KEY_RE.fullmatch(name):
        raise ValueError(f"lease name {name[:80]!r} is not a key")
    token = secrets.token_hex(16)
    body = json.dumps(
        {
            "token": token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "expires": time.time() + ttl_s,
        }
    ).encode()
    for _ in range(2):
        if store.create_lease(name, body):
            return Lease(store, name, token)
        held = _holder(_read(store, name))
        if held is not None and _expires(held) > time.time() and not _dead_here(held):
            return None
        store.delete_lease(name)  # NOTE: expired, unreadable, or its holder is gone
    return None


def holder(store: Store, name: str) -> str:
    """Who holds the lease, for log lines."""
    held = _holder(_read(store, name)) or {}
    return f"{held.get('host', '?')} pid {held.get('pid', '?')}"


def _read(store: Store, name: str) -> bytes | None:
    """The lease's bytes; a FIFO, a link or a directory in its place reads as garbage (and so
    is removed as an unreadable lease)."""
    try:
        return store.get_lease(name)
    except IntegrityError:
        return b""


def _holder(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        held = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return held if isinstance(held, dict) else {}


def _dead_here(held: dict) -> bool:
    """The holder ran on this host and its process is gone (killed mid-publish): its lease
    need not be waited out."""
    pid = held.get("pid")
    if held.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    return not pid_alive(pid)


def _expires(held: dict) -> float:
    value = held.get("expires")
    return float(value) if isinstance(value, int | float) else 0.0
