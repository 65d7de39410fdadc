"""A per-node cache in front of a remote snapshot store (S3).

The cache is a ``LocalStore`` directory shared by every replica and model on the node
(content-addressed chunks, so two models that share tensors share their bytes). Before a
replica starts, the snapshots of its model (tier A and tier P) are pulled from the remote
store, moving only the chunks the node lacks; the replica then restores from local disk (a
sandboxed worker maps its weights from the cache's chunk files, so tier P works with an S3
store). What a start published into the cache is pushed back to the remote store. The cache
is size-bounded: the least recently used snapshots go first, never one this start uses.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from warmboot.snapshot.deadline import run_with_deadline
from warmboot.snapshot.key import model_files_digest
from warmboot.snapshot.ops import copy_snapshot, manifest_refs, remove_snapshot
from warmboot.snapshot.store import LocalStore, Store

log = logging.getLogger("warmboot")


def default_cache_dir() -> Path:
    from warmboot.config import cache_root

    return cache_root() / "node-cache"


class NodeCache:
    def __init__(self, remote: Store, root: Path, max_bytes: int, timeout_s: float = 30.0):
        self.remote = remote
        self.local = LocalStore(root)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        return self.local.url

    def keys_for(self, store: Store, model_dir: Path) -> list[str]:
        """Keys in ``store`` of snapshots of this model (either kind)."""
        digest = model_files_digest(Path(model_dir))
        return [k for k in store.list_keys() if _model_digest(store, k) == digest]

    def pull(self, model_dir: Path) -> list[str]:
        """Copy this model's snapshots from the remote store (missing chunks only, each
        verified); returns the keys now in the cache. Bounded by the store deadline."""

        def step(progress) -> list[str]:
            keys = self.keys_for(self.remote, model_dir)
            for key in keys:
                progress(0)
                moved = copy_snapshot(self.remote, self.local, key, progress)
                self._touch(key)
                log.info(
                    "node cache: %s from %s (%.1f MB moved)", key, self.remote.url, moved / 1e6
                )
            return keys

        keys = run_with_deadline("node cache pull", step, self.timeout_s)
        self.evict(keep=set(keys))
        return keys

    def push(self, model_dir: Path) -> list[str]:
        """Copy this model's snapshots that the remote store lacks (a publish made here)."""

        def step(progress) -> list[str]:
            have = set(self.remote.list_keys())
            new = [k for k in self.keys_for(self.local, model_dir) if k not in have]
            for key in new:
                copy_snapshot(self.local, self.remote, key, progress)
            return new

        return run_with_deadline("node cache push", step, self.timeout_s)

    def evict(self, keep: set[str]) -> int:
        """Remove least recently used snapshots (not in ``keep``) while the cache holds more
        than ``max_bytes``; returns the bytes freed."""
        freed, total = 0, self.local.stored_bytes()
        by_age = sorted(self.local.list_keys(), key=self._last_used)
        for key in by_age:
            if total - freed <= self.max_bytes:
                break
            if key not in keep:
                freed += remove_snapshot(self.local, key)
        return freed

    def _touch(self, key: str) -> None:
        path = self.local.root / "manifests" / f"{key}.json"
        try:
            os.utime(path, follow_symlinks=False)
        except OSError:
            pass

    def _last_used(self, key: str) -> float:
        try:
            return (self.local.root / "manifests" / f"{key}.json").lstat().st_mtime
        except OSError:
            return 0.0


def _model_digest(store: Store, key: str) -> str | None:
    """The ``model_files`` field of a snapshot of either kind (None if unreadable)."""
    try:
        _, data = manifest_refs(store, key)
        fields = json.loads(data).get("fields", {})
    except Exception:  # noqa: BLE001 - a manifest we cannot read is not ours to pull
        return None
    return fields.get("model_files") if isinstance(fields, dict) else None
