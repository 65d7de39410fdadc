"""``warmboot serve`` as a user runs it: a subprocess on 127.0.0.1, with a snapshot store, so
the second start restores the first start's engine image and answers the same; it says what
it is doing as it starts, and exits at once, with the reason, when the model cannot be served."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

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
    answers, paths, logs = [], [], []
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
            logs.append(proc.stdout.read().decode())
    assert paths == ["cold", second]
    assert answers[0] == answers[1] and answers[0]
    for log in logs:  # NOTE: start-up lines show without -v, each phase as it begins and ends
        assert f"serving {MODEL_NAME!r} on http://127.0.0.1:" in log, log
        assert "engine ready after" in log and "(since process start" in log, log
    assert "load_weights ..." in logs[0] and "load_weights done in" in logs[0], logs[0]
    assert "load_weights" not in logs[1], logs[1]


def test_serve_reads_the_api_key_from_the_environment(path, tmp_path):
    proc, url = _serve(path, tmp_path / "snapshots", key="k-123")
    try:
        _wait_healthy(proc, url)
        assert httpx.post(url + "/v1/completions", json={}).status_code == 401
        assert _complete(url, {"Authorization": "Bearer k-123"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _unsupported(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["FooBarForCausalLM"], model_type="foobar")
    (model_dir / "config.json").write_text(json.dumps(config))


def _corrupt(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidd')


@pytest.mark.parametrize(
    ("damage", "extra", "reason"),
    [
        (None, [], "does not exist"),
        (_unsupported, [], "unsupported architecture ['FooBarForCausalLM']"),
        (_corrupt, [], "config.json is not valid JSON"),
        (lambda d: None, ["--max-model-len", "100000"], "exceeds the model's context"),
    ],
    ids=["missing", "unsupported", "corrupt_config", "fatal_in_boot"],
)
def test_serve_exits_with_the_reason_when_the_model_cannot_be_served(
    path, tmp_path, damage, extra, reason
):
    """Found before the server starts (preflight) or while the engine boots: exit 2 within
    seconds, the reason on stderr in one line, no traceback, no server left answering 503."""
    model = tmp_path / "model"
    if damage is not None:
        shutil.copytree(path, model)
        damage(model)
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model), "--port", "0"]
    t0 = time.monotonic()
    cmd += ["--sandbox", "none", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: cannot serve {model}: ") and reason in line, run.stderr
    assert "Traceback" not in run.stderr
