"""``warmboot serve`` as a user runs it: a subprocess on 127.0.0.1, with a snapshot store, so
the second start restores the first start's engine image and answers the same."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_harness import MODEL_NAME
from warmboot.launcher.sandbox import runsc_status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model, store, key: str | None = None, sandbox="none") -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--served-model-name", MODEL_NAME, "--max-model-len", "128"]
    cmd += ["--snapshot-store", str(store), "--sandbox", sandbox]
    env = {**os.environ, "WARMBOOT_API_KEY": key} if key else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            resp = httpx.get(url + "/health", timeout=2)
            if resp.status_code == 200:
                return resp.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("warmboot serve never became healthy")


def _complete(url: str, headers=None) -> str:
    body = {"model": MODEL_NAME, "prompt": "snap", "max_tokens": 8, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


RUNSC, NO_RUNSC = runsc_status()


@pytest.mark.parametrize(
    ("sandbox", "second"),
    [
        ("none", "restored_image"),
        pytest.param(
            "auto",
            "restored_process",
            marks=[
                pytest.mark.skipif(RUNSC is None, reason=f"gVisor: {NO_RUNSC}"),
                pytest.mark.slow,
            ],
        ),
    ],
)
def test_serve_cold_then_restored_answers_the_same(path, tmp_path, sandbox, second):
    """--sandbox none: tier A (engine image); auto with runsc: tier P (process image)."""
    store = tmp_path / "snapshots"
    answers, paths = [], []
    for _ in range(2):
        proc, url = _serve(path, store, sandbox=sandbox)
        try:
            health = _wait_healthy(proc, url)
            paths.append(health["start_path"])
            answers.append(_complete(url))
            metrics = httpx.get(url + "/metrics").text
            assert f'warmboot_start_info{{path="{health["start_path"]}"' in metrics
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert paths == ["cold", second]
    assert answers[0] == answers[1] and answers[0]


def test_serve_reads_the_api_key_from_the_environment(path, tmp_path):
    proc, url = _serve(path, tmp_path / "snapshots", key="k-123")
    try:
        _wait_healthy(proc, url)
        assert httpx.post(url + "/v1/completions", json={}).status_code == 401
        assert _complete(url, {"Authorization": "Bearer k-123"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
