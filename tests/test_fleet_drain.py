"""A stream across a downscale: two streams on two replicas, the load drops to what one
replica takes, one replica is scaled down while its stream runs, and that stream finishes
with every token and ``[DONE]`` (Serve drains the replica before it goes). The built-in demo
model: its decode is slow enough on the CPU for a stream to outlast the downscale delay."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_fleet import WAIT_S

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow
PORT = 18767
HOLD_TOKENS = 1900  # NOTE: A runs until B has a replica, however long the second one takes
LONG_TOKENS = 280


@pytest.fixture(scope="module")
def demo_fleet(tmp_path_factory):
    import httpx

    from warmboot.fleet import app as fleet_app
    from warmboot.fleet.config import AutoscalingConfig, FleetConfig
    from warmboot.models.demo import ensure_default_model

    cfg = FleetConfig(
        model_id="tiny",  # NOTE: the name tests.test_fleet.stream asks for
        model_source=str(ensure_default_model()),
        engine_kwargs={"max_model_len": 2048, "max_num_seqs": 4, "cpu_threads": 1},
        snapshot_store=str(tmp_path_factory.mktemp("drain") / "store"),
        sandbox="none",
        drain_timeout_s=120,
        autoscaling=AutoscalingConfig(
            min_replicas=0,
            max_replicas=2,
            target_ongoing_requests=1,
            max_ongoing_requests=1,
            downscale_delay_s=1,
        ),
    )
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=60)
    fleet_app.run_fleet(cfg, PORT, blocking=False)
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=WAIT_S)
    yield client
    client.close()
    fleet_app.shutdown()


def test_streams_finish_across_a_downscale(demo_fleet):
    client = demo_fleet
    base = f"http://127.0.0.1:{PORT}"
    seen, stop = [], threading.Event()

    def watch():
        while not stop.wait(0.2):
            seen.append((time.monotonic(), client.get("/health").json()["replicas"]))

    threading.Thread(target=watch, daemon=True).start()

    async def run():
        # NOTE: A takes the first replica; B waits for a second (one request per replica).
        # A streams until B's replica answers, then goes away: the load fits one replica,
        # and Serve stops the newest, B's, mid-stream. (A fixed-length A raced the second
        # replica's start: on a fast CPU it ended first and B took A's replica.)
        started = asyncio.Event()
        a = asyncio.ensure_future(stream_until(base, "stream A", HOLD_TOKENS, started))
        await asyncio.sleep(0.5)
        b = asyncio.ensure_future(stream(base, "stream B", LONG_TOKENS, started))
        return await asyncio.gather(a, b)

    t0 = time.monotonic()
    try:
        a, b = asyncio.run(run())
    finally:
        stop.set()
    t1 = time.monotonic()
    assert a["status"] == 200 and not a["done"] and a["text"], f"A ran until B started: {a}"
    assert b["status"] == 200 and b["done"] and not b["errors"], b
    assert a["replica"] != b["replica"], f"precondition: A and B on two replicas: {a, b}"
    assert b["tokens"] == LONG_TOKENS, f"B lost tokens across the downscale: {b}"
    states = [s for t, s in seen if t0 <= t <= t1]
    assert max(s["running"] for s in states) == 2, "precondition: two replicas were up"
    stopping = [s for s in states if s["stopping"]]
    assert stopping, f"no replica was stopped while B streamed: {states[-8:]}"


async def stream(
    base: str, prompt: str, max_tokens: int, started: asyncio.Event, out: dict | None = None
) -> dict:
    """Stream a completion into ``out``, counting its tokens; set ``started`` when the
    replica answers."""
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    out = {} if out is None else out
    out.update(text="", done=False, errors=[], tokens=0)
    async with httpx.AsyncClient(base_url=base, timeout=WAIT_S) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get("x-warmboot-replica")
            started.set()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    _take(out, json.loads(line[6:]))
    return out


def _take(out: dict, chunk: dict) -> None:
    if "error" in chunk:
        out["errors"].append(chunk["error"])
    if chunk.get("usage"):
        out["tokens"] = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
        out["text"] += choice["text"]


async def stream_until(base: str, prompt: str, max_tokens: int, other: asyncio.Event) -> dict:
    """Stream until ``other`` is set (the other stream has its replica), then disconnect."""
    out = {}
    task = asyncio.ensure_future(stream(base, prompt, max_tokens, asyncio.Event(), out))
    got = asyncio.ensure_future(other.wait())
    await asyncio.wait([task, got], return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        await asyncio.sleep(0.5)  # NOTE: A is seen streaming beside B before it goes
        task.cancel()
    await asyncio.gather(task, got, return_exceptions=True)
    return out
