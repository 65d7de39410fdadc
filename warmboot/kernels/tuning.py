"""Launch configurations for the attention kernels: a fixed one in the interpreter, measured
ones on a GPU, persisted as JSON so a snapshot carries them.

The cache file is ``$WARMBOOT_CACHE/autotune/attention.json`` (default
``~/.cache/warmboot``): ``{key: config}``, where a key names the kernel, the device and the
compile-time shape (head dim, dtype, mask flags, sequence-length bucket).
``export_autotune_cache()`` / ``import_autotune_cache()`` move it in and out of a tier-A
snapshot (its manifest's ``autotune`` fact; ``snapshot/boot.py``).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

from warmboot.config import cache_root

log = logging.getLogger(__name__)

Config = dict[str, int]
"""Keyword arguments of a launch: constexprs (BLOCK_M, ...) plus num_warps / num_stages."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def warp_specialize_supported(device: torch.device) -> bool:
    """A GPU and a Triton that implement ``tl.range(warp_specialize=True)``.

    NOTE: Triton 3.6 implements it on Blackwell only; on sm_90 it compiles to the same SASS
    as without (bench/sass_check.py), so Hopper gets it from the next Triton on, where the
    tuner keeps it only if it measures faster."""
    if interpreting() or device.type != "cuda":
        return False
    if "warp_specialize" not in inspect.signature(tl.range.__init__).parameters:
        return False
    major = torch.cuda.get_device_capability(device)[0]
    newer = tuple(int(x) for x in triton.__version__.split(".")[:2]) > (3, 6)
    return major >= 10 or (major == 9 and newer)


def autotune_cache_path() -> Path:
    return cache_root() / "autotune" / "attention.json"


class Tuner:
    """Benchmarks candidate configs once per key, keeps the fastest (in memory and on disk)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._best: dict[str, Config] = {}
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = autotune_cache_path()
        if path.is_file():
            try:
                self._best.update(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                log.warning("ignoring unreadable autotune cache %s: %s", path, e)

    def _save(self) -> None:
        path = autotune_cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._best, indent=1, sort_keys=True))
        tmp.replace(path)

    def pick(self, key: str, candidates: list[Config], run: Callable[[Config], None]) -> Config:
        """The cached config for ``key``, else the fastest candidate that compiles and runs."""
        with self._lock:
            self._load()
            if key in self._best:
                return self._best[key]
        timings = []
        for cfg in candidates:
            try:
                ms = triton.testing.do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=25)
            except Exception as e:  # a config the compiler or the chip rejects
                log.info("autotune %s: %s rejected (%s)", key, cfg, type(e).__name__)
                continue
            timings.append((ms, cfg))
        if not timings:
            raise RuntimeError(f"autotune {key}: no candidate config ran")
        best = min(timings, key=lambda t: t[0])[1]
        with self._lock:
            self._best[key] = best
            self._save()
        return best

    def export(self) -> dict[str, Config]:
        with self._lock:
            self._load()
            return dict(self._best)

    def import_(self, entries: dict[str, Config], persist: bool = True) -> None:
        with self._lock:
            self._load()
            self._best.update(entries)
            if persist:
                self._save()


TUNER = Tuner()


def export_autotune_cache() -> dict[str, Config]:
    """All measured configs (JSON-serialisable), e.g. to store in a snapshot."""
    return TUNER.export()


def import_autotune_cache(entries: dict[str, Config], persist: bool = True) -> None:
    """Adopt configs measured elsewhere (same GPU model and Triton), skipping the tuning."""
    TUNER.import_(entries, persist)


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_") + f"-triton{triton.__version__}"


def seqlen_bucket(n: int) -> int:
    """Tuning bucket of a sequence length: next power of two, 128 .. 16384."""
    return min(16384, max(128, triton.next_power_of_2(max(n, 1))))


SEQLEN_BUCKETS = tuple(128 << i for i in range(8))
"""Every value ``seqlen_bucket`` can return."""


def prefill_shapes(max_q: int, max_k: int) -> list[tuple[int, int]]:
    """One (query, key) length pair per (query bucket, key bucket) that a causal prefill
    can meet with up to ``max_q`` new and ``max_k`` total tokens (queries <= keys): tuning
    these ahead of traffic leaves nothing to tune (or compile) while serving."""
    top_q = seqlen_bucket(min(max_q, max_k))
    top_k = seqlen_bucket(max_k)
    shapes = []
    for bq in SEQLEN_BUCKETS:
        if bq > top_q:
            break
        q_len = min(bq, max_q, max_k)
        for bk in SEQLEN_BUCKETS:
            if bq <= bk <= top_k:
                shapes.append((q_len, max(q_len, min(bk, max_k))))
    return shapes
