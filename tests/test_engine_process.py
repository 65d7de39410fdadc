"""``warmboot serve --engine-process on``: the engine in a plain child process (the worker
without gVisor) behind the HTTP front end. It answers as the in-process engine does, streams
and aborts, keeps the front end off its compute cores, reports a killed child (and replaces
it), drains on SIGTERM, and never outlives the server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import MODEL_NAME
from warmboot import LLM, SamplingParams
from warmboot.config import EAGER_ENV
from warmboot.launcher import engine_process, spare_hints
from warmboot.launcher.launch import LaunchConfig, launch
from warmboot.launcher.local import wants_gpu

MAX_LEN = 512
USAGE = {"stream_options": {"include_usage": True}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``warmboot serve`` in a session of its own (so a group signal reaches its child too)."""

    def __init__(self, model: Path, log: Path, *extra: str):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model)]
        cmd += ["--port", str(port), "--served-model-name", MODEL_NAME, "--debug-endpoints"]
        cmd += ["--max-model-len", str(MAX_LEN), *extra]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def healthy(self, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                resp = httpx.get(self.url + "/health", timeout=2)
                if resp.status_code == 200:
                    return resp.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"never healthy: {self.log.read_text()}")

    def child(self) -> int:
        """The engine process's pid (named in /health), checked to be this server's child."""
        reason = self.healthy()["start_reason"]
        pid = int(re.search(r"engine process \(pid (\d+)", reason).group(1))
        assert _ppid(pid) == self.proc.pid
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ppid(pid: int) -> int:
    return int(_stat(pid)[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _events(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    srv = Server(
        path, tmp_path_factory.mktemp("engine-process") / "serve.log", "--engine-process", "on"
    )
    srv.healthy()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(path) -> str:
    """What the in-process engine answers (greedy)."""
    llm = LLM(str(path), max_model_len=MAX_LEN)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return llm.generate("hello there", params)[0].outputs[0].text
    finally:
        llm.close()


def test_completions_and_streams_match_the_in_process_engine(server, reference):
    whole = httpx.post(server.url + "/v1/completions", json=_body("hello there", 12), timeout=30)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == reference
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=_body("hello there", 12, True), timeout=30
    ) as resp:
        chunks = [e["choices"][0]["text"] for e in _events(resp) if e.get("choices")]
    assert "".join(chunks) == reference and len(chunks) > 1
    metrics = httpx.get(server.url + "/metrics").text
    assert "warmboot_kv_blocks_capacity" in metrics and 'warmboot_start_info{path="cold"' in metrics


def test_a_dropped_stream_is_aborted_in_the_engine_process(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=_body("abort me", MAX_LEN - 32, True),
        timeout=30,
    ) as resp:
        events = _events(resp)
        next(events), next(events)  # NOTE: leaving the block drops the connection
    for _ in range(200):
        state = httpx.get(server.url + "/debug/engine").json()
        if not state["unfinished"]:
            break
        time.sleep(0.02)
    assert state["invariants_ok"] and not state["unfinished"] and state["kv_blocks_used"] == 0
    assert "warmboot_requests_aborted_total 1.0" in httpx.get(server.url + "/metrics").text


def test_the_front_end_keeps_off_the_engine_compute_cores(server):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    child = server.child()
    reason = server.healthy()["start_reason"]
    assert "started ahead" in reason, "serve starts its engine process before it picks a path"
    front = _allowed(server.proc.pid)
    engine = _allowed(child)
    pinned = [cpus for cpus in engine if cpus < max(engine, key=len)]
    assert pinned, f"no compute thread pinned in the engine process: {engine}"
    assert all(not (cpus & pinned[0]) for cpus in front), (front, pinned)


def _allowed(pid: int) -> list[set[int]]:
    """Each thread's CPUs."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.append(os.sched_getaffinity(int(task.name)))
        except OSError:
            pass  # NOTE: a thread that just ended
    return out


def test_a_killed_engine_process_is_reported_and_replaced(server, reference):
    old = server.child()
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=_body("kill me", MAX_LEN - 32, True),
        timeout=30,
    ) as resp:
        events = _events(resp)
        next(events)
        os.kill(old, signal.SIGKILL)
        rest = list(events)
    error = rest[-1]["error"]["message"]
    assert "killed by SIGKILL" in error and str(old) in error, rest[-1]
    health = httpx.get(server.url + "/health")
    if health.status_code == 503:  # NOTE: unless the replacement booted already
        assert health.json()["status"] == "restarting", health.text
        assert "killed by SIGKILL" in health.json()["engine_died"]
    assert server.healthy() and server.child() != old and not _alive(old)
    assert "started ahead" not in server.healthy()["start_reason"], "the spare serves once"
    again = httpx.post(server.url + "/v1/completions", json=_body("hello there", 12), timeout=30)
    assert again.json()["choices"][0]["text"] == reference
    assert "warmboot_engine_restarts_total 1.0" in httpx.get(server.url + "/metrics").text


def test_a_killed_server_takes_its_engine_process_along(server):
    child = server.child()  # NOTE: the replacement, started by another thread than the first
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    assert _gone_within(child, 10), "the engine process outlived its server"


def test_sigterm_drains_the_streams_then_stops_the_engine_process(path, tmp_path):
    """A group SIGTERM (a service manager's, a Ctrl-C's SIGINT alike) reaches the child too:
    it keeps serving until the server has drained its streams, then stops."""
    on_gpu = wants_gpu({})
    # NOTE: the default (auto) runs an engine process on the CPU
    srv = Server(path, tmp_path / "serve.log", *(["--engine-process", "on"] if on_gpu else []))
    try:
        child = srv.child()
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json=_body("drain", 64, True) | USAGE, timeout=30
        ) as resp:
            events = _events(resp)
            first = next(events)
            os.killpg(srv.proc.pid, signal.SIGTERM)
            rest = [first, *events]
        finish = [c["finish_reason"] for e in rest for c in e.get("choices", [])]
        assert finish[-1] == "length" and rest[-1]["usage"]["completion_tokens"] == 64, rest[-1]
        srv.proc.wait(timeout=30)
        assert _gone_within(child, 10), "the engine process outlived its server"
    finally:
        srv.stop()


def test_a_spare_engine_process_serves_only_the_start_it_was_made_for(path):
    """``serve`` starts an engine process before it knows the settings; a start on other
    CPUs or threads (or one that runs elsewhere: ``drop_spare``) ends it, never uses it."""
    engine = {
        "model": str(path),
        "max_model_len": 64,
        "num_kv_blocks": 32,
        "cpu_threads": 1,
        "enforce_eager": True,
    }
    cfg = LaunchConfig(engine=engine, sandbox="none", engine_process="on")
    for threads, used in ((2, False), (1, True)):
        engine_process.prestart(None, threads)
        spare = engine_process._spare[-1][1].proc.pid
        client = launch(cfg)
        try:
            assert ("started ahead" in client.start_info.reason) is used, client.start_info
            assert f"(pid {spare}" in client.start_info.reason or _gone_within(spare, 10)
            assert client.stats()["kv_blocks_total"] == 32, "booted with these settings"
        finally:
            client.shutdown()
    engine_process.prestart(None, 1)
    spare = engine_process._spare[-1][1].proc.pid
    engine_process.drop_spare()
    assert _gone_within(spare, 10) and not engine_process._spare


def test_no_spare_where_the_engine_will_run_in_gvisor(tmp_path, monkeypatch):
    """A restore kills the spare, and the spare held it back: a start that can run its engine
    in gVisor makes none, unless the last start of its launch ran the engine locally."""
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path))
    monkeypatch.setattr(spare_hints.shutil, "which", lambda name: f"/usr/bin/{name}")
    launch_id = spare_hints.launch_id
    hint = launch_id("m", str(tmp_path / "store"), "auto")
    assert hint and hint != launch_id("m", str(tmp_path / "other"), "auto")
    for store, sandbox in ((None, "auto"), ("s", "none"), ("s3://bucket/p", "auto")):
        assert launch_id("m", store, sandbox) is None, "runs locally: always a spare"
    made = []
    monkeypatch.setattr(engine_process, "Child", lambda *a: made.append(a) or object())
    try:
        for sandboxed, spare in ((None, False), (False, True), (True, False), (False, True)):
            if sandboxed is not None:
                spare_hints.remember(hint, sandboxed)
            made.clear()
            engine_process.prestart(None, 1, hint)
            assert bool(made) is spare, (sandboxed, made)
        made.clear()
        engine_process.prestart(None, 1, None)
        assert made, "a launch that never runs in gVisor always gets its spare"
    finally:
        engine_process._spare.clear()
    monkeypatch.setattr(spare_hints.shutil, "which", lambda name: None)
    assert launch_id("m", str(tmp_path / "store"), "auto") is None, "no runsc: runs locally"
    spare_hints.hints_path().write_text("{not json")
    assert spare_hints.expects_gvisor(hint), "an unreadable file: the guess"
    for n in range(spare_hints.KEPT + 5):
        spare_hints.remember(f"launch-{n}", True)
    assert len(json.loads(spare_hints.hints_path().read_text())) == spare_hints.KEPT


def test_a_new_replica_takes_the_spare_hint_from_the_store(tmp_path, monkeypatch):
    """A new replica (an empty cache) has no hint of its own: it takes the word its launch's
    starts left in the store's record for its kind of host (once their costs were on record:
    ``on_recorded``), and guesses gVisor without one. A host's own word comes first."""
    from warmboot.snapshot.start_costs import host_class
    from warmboot.snapshot.store import LocalStore

    monkeypatch.setattr(spare_hints.shutil, "which", lambda name: f"/usr/bin/{name}")
    store = str(tmp_path / "store")
    hint = spare_hints.launch_id("m", store, "auto")
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "host-1"))
    assert spare_hints.expects_gvisor(hint, store), "nothing on record anywhere: the guess"
    spare_hints.remember(hint, False, store=store)
    spare_hints.remember("another launch", True, store=store)
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "host-2"))  # NOTE: a new replica
    assert not spare_hints.expects_gvisor(hint, store), "the store's word: a local start"
    assert spare_hints.expects_gvisor("another launch", store)
    assert spare_hints.expects_gvisor(hint), "no store given: the guess"
    spare_hints.remember(hint, True)  # NOTE: this host's own word, not shared
    assert spare_hints.expects_gvisor(hint, store), "this host's word comes first"
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "host-3"))
    assert not spare_hints.expects_gvisor(hint, store), "the store kept host 1's word"
    LocalStore(store).put_record(f"spare-hints-{host_class()}", b"[not a dict")
    assert spare_hints.expects_gvisor(hint, store), "a record that is no dict: the guess"


def test_an_engine_process_told_to_stop_while_it_compiles_stops_at_once(
    path, tmp_path, monkeypatch
):
    """The default mode's compile runs in the background for tens of seconds after a cold
    start; a server stopped meanwhile used to wait 10 s for its engine process, then kill it."""
    monkeypatch.delenv(EAGER_ENV)  # NOTE: the mode unsaid, as outside the suite
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # NOTE: no hits
    engine = {"model": str(path), "max_model_len": 64, "num_kv_blocks": 32}
    client = launch(LaunchConfig(engine=engine, sandbox="none", engine_process="on"))
    assert client.stats()["compile"].get("state") == "compiling", client.stats()["compile"]
    t0 = time.monotonic()
    client.shutdown()
    assert time.monotonic() - t0 < 5.0


def test_settings_the_engine_refuses_fail_without_an_in_process_retry(path):
    engine = {"model": str(path), "max_model_len": 100_000}
    with pytest.raises(ValueError, match="exceeds the model's context"):
        launch(LaunchConfig(engine=engine, sandbox="none", engine_process="on"))


def test_the_launcher_says_its_path_is_chosen_before_the_engine_boots(path):
    """``serve`` imports its HTTP stack once the path is chosen (``LaunchConfig.on_path``),
    not beside the launcher's key and lookup: told before the boot (which fails here)."""
    chosen = []
    engine = {"model": str(path), "max_model_len": 100_000}
    cfg = LaunchConfig(engine=engine, sandbox="none", engine_process="on", on_path=chosen.append)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        launch(cfg)
    assert chosen == [False], "told once, the engine outside gVisor"


def test_an_engine_process_that_cannot_start_falls_back_in_process(path, monkeypatch):
    monkeypatch.setattr(engine_process, "_argv", lambda engine: [sys.executable, "-c", "pass"])
    engine = {"model": str(path), "max_model_len": 64, "num_kv_blocks": 32}
    client = launch(LaunchConfig(engine=engine, sandbox="none", engine_process="on"))
    try:
        assert client.start_info.fallbacks == ("engine_process_failed",)
        assert "exited before sending 'booted'" in client.start_info.reason
        assert type(client).__name__ == "AsyncLLM"
    finally:
        client.shutdown()


def test_an_idle_engine_process_reports_its_background_compile(path, monkeypatch):
    """Mode unsaid: the engine serves eager steps and compiles in the background; with no
    request in flight the worker still reports when that compile is done."""
    import time

    from warmboot.config import EAGER_ENV

    monkeypatch.delenv(EAGER_ENV)
    engine = {"model": str(path), "max_model_len": 64, "num_kv_blocks": 32}
    client = launch(LaunchConfig(engine=engine, sandbox="none", engine_process="on"))
    try:
        assert client.stats()["compile"]["state"] == "compiling", client.stats()["compile"]
        deadline = time.monotonic() + 300
        while "step_choice" not in client.stats()["compile"] and time.monotonic() < deadline:
            time.sleep(0.2)
        info = client.stats()["compile"]  # NOTE: compiled, or eager where it measured faster
        assert info["background"] and info["step_choice"]["source"] == "measured", info
        assert info["compiled"] == (info["step_choice"]["mode"] == "compiled")
    finally:
        client.shutdown()
