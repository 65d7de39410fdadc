"""A stream across a downscale: two long streams on two replicas, the load drops to what one
replica takes, one replica is scaled down while its stream runs, and both streams finish
with every token and ``[DONE]`` (Serve drains the replica before it goes). The built-in demo
model: its decode is slow enough on the CPU for a stream to outlast the downscale delay."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_fleet import WAIT_S, stream

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow
PORT = 18767
SHORT_TOKENS = 150
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
        engine_kwargs={"max_model_len": 320, "max_num_seqs": 4, "cpu_threads": 1},
        snapshot_store=str(tmp_path_factory.mktemp("drain") / "store"),
        sandbox="none",
        drain_timeout_s=120,
        autoscaling=AutoscalingConfig(
            min_replicas=0,
            max_replicas=2,
            target_ongoing_requests=1,
            max_ongoing_requests=1,
            downscale_delay_s=1,
        ),  # fmt: skip
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
        # When A ends the load fits one replica, and Serve stops the newest: B's, mid-stream.
        a = asyncio.ensure_future(stream(base, "stream A", SHORT_TOKENS))
        await asyncio.sleep(0.5)
        b = asyncio.ensure_future(stream(base, "stream B", LONG_TOKENS))
        return await asyncio.gather(a, b)

    t0 = time.monotonic()
    try:
        results = asyncio.run(run())
    finally:
        stop.set()
    t1 = time.monotonic()
    assert all(r["status"] == 200 and r["done"] and not r["errors"] for r in results), results
    a, b = results
    assert a["replica"] != b["replica"], f"precondition: A and B on two replicas: {results}"
    assert len(b["text"]) > len(a["text"])
    states = [s for t, s in seen if t0 <= t <= t1]
    assert max(s["running"] for s in states) == 2, "precondition: two replicas were up"
    stopping = [s for s in states if s["stopping"]]
    assert stopping, f"no replica was stopped while B streamed: {states[-8:]}"
