"""Server processes for the serving benchmarks: a free port, ``warmboot serve``'s command line,
waiting for ``/health``, stopping a process group. vLLM's server is ``bench.peers.vllm_cpu``'s."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_cmd(model: str | Path, port: int, *flags: str) -> list[str]:
    """``warmboot serve`` of ``model`` on ``port``, in this interpreter, then ``flags``."""
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model)]
    return [*cmd, "--port", str(port), *flags]


def healthy(url: str, client=None, timeout_s: float = 2.0) -> bool:
    """Whether ``url/health`` answers 200 (``client``: an ``httpx.Client`` to reuse)."""
    import httpx

    try:
        get = client.get if client is not None else httpx.get
        return get(url + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    t0: float | None = None,
    timeout_s: float = 600.0,
    interval_s: float = 0.2,
    client=None,
    probe_s: float = 2.0,
) -> float:
    """Seconds from ``t0`` (``time.monotonic()``; default now) until ``url`` is healthy.
    Raises ``RuntimeError`` when the process exits or ``timeout_s`` passes first."""
    t0 = time.monotonic() if t0 is None else t0
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if healthy(url, client, probe_s):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the server did not become healthy in {timeout_s:g} s")
        time.sleep(interval_s)


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to ``proc``'s process group (it was started in a new session), SIGKILL after
    ``grace_s`` or once the leader is gone, and to stragglers whose leader already exited."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            break
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
