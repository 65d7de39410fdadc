"""What the host machine is, read the same inside and outside a gVisor sandbox: its CPU model
and flags (the native kernels' build key, snapshot keys, the start path's choices)."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

HOST_CPU_ENV = "WARMBOOT_HOST_CPU"
HOST_NATIVE_ENV = "WARMBOOT_HOST_NATIVE"
"""Set by the launcher for its sandboxed worker: the host's native-library cache directory
(``kernels.native``), read-only in there; not part of a process key."""


@cache
def host_cpu_features() -> str:
    """The host's CPU as ``model | sorted flags``, read the same inside and outside gVisor:
    the sandbox's /proc/cpuinfo hides flags (``amx_*`` and others), so the launcher hands the
    host's own reading to its worker in ``$WARMBOOT_HOST_CPU``. A tier-A image holds weights
    and no CPU-specific code, so the host's flags are the right key for one made inside."""
    model, flags = _cpu_info()
    return os.environ.get(HOST_CPU_ENV) or f"{model} | {flags}"


def host_cpu_flags(reading: str | None = None) -> frozenset[str]:
    """The CPU flags a ``model | flags`` reading lists (the host's by default)."""
    reading = host_cpu_features() if reading is None else reading
    return frozenset(reading.partition(" | ")[2].split())


@cache
def _cpu_info() -> tuple[str, str]:
    """(model name, sorted CPU flags) of the first processor in /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and model in ("", platform.machine()):
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    return model, flags
