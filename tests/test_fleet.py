"""The fleet on a real local Ray (loopback, bounded waits): scale from zero to the first token
and back to zero, a burst to two replicas and back, a stream across a downscale that
completes, the queue bound, greedy tokens identical to a single engine's, and nothing left
running afterwards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
PORT = 18765
ENGINE = {"max_model_len": 128, "block_size": 4, "num_kv_blocks": 64, "cpu_threads": 1}
WAIT_S = 90.0
"""Every wait on the fleet is bounded by this."""


@pytest.fixture(scope="module")
def fleet(path, tmp_path_factory):
    import httpx

    from warmboot.fleet import app as fleet_app
    from warmboot.fleet.config import AutoscalingConfig, FleetConfig

    store = tmp_path_factory.mktemp("fleet") / "store"
    cfg = FleetConfig(
        model_id="tiny",
        model_source=str(path),
        engine_kwargs=ENGINE,
        snapshot_store=str(store),
        sandbox="none",
        max_queued_requests=6,
        autoscaling=AutoscalingConfig(
            min_replicas=0, max_replicas=2, target_ongoing_requests=2, downscale_delay_s=3
        ),
    )
    ray_cli = Path(sys.executable).with_name("ray")  # NOTE: a Ray left by an earlier run goes
    subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=60)
    fleet_app.run_fleet(cfg, PORT, blocking=False)
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=WAIT_S)
    yield cfg, client
    client.close()
    fleet_app.shutdown()  # NOTE: the last test has stopped it already; this is idempotent


def replicas(client) -> dict:
    return client.get("/health").json()["replicas"]


def wait_for(client, cond, what: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        state = replicas(client)
        if cond(state):
            return state
        time.sleep(0.25)
    raise AssertionError(f"fleet never reached {what}: {replicas(client)}")


def idle(state: dict) -> bool:
    return not any(state.values())


def single_engine_texts(path, prompts: list[str], max_tokens: int) -> list[str]:
    from warmboot import LLM, SamplingParams

    llm = LLM(str(path), **{k: v for k, v in ENGINE.items() if k != "cpu_threads"})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


async def stream(base: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    out = {"text": "", "done": False, "errors": []}
    async with httpx.AsyncClient(base_url=base, timeout=WAIT_S) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
            out["replica"] = r.headers.get("x-warmboot-replica")
            if r.status_code != 200:
                return out
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["errors"].append(chunk["error"])
                    else:
                        out["text"] += chunk["choices"][0]["text"]
    return out


def test_scale_from_zero_to_first_token_and_back(fleet, path):
    cfg, client = fleet
    wait_for(client, idle, "zero replicas")
    for _ in range(4):  # health and metrics never wake a replica
        assert client.get("/health").status_code == 200
        assert "warmboot_fleet_replicas" in client.get("/metrics").text
    time.sleep(1.0)
    assert idle(replicas(client))
    prompts = ["The fleet", "scales from zero"]
    t0 = time.monotonic()
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = [client.post("/v1/completions", json=body | {"prompt": p}) for p in prompts]
    first_s = time.monotonic() - t0
    assert [r.status_code for r in got] == [200, 200], got[0].text
    texts = [r.json()["choices"][0]["text"] for r in got]
    assert texts == single_engine_texts(path, prompts, 8), "the fleet answers like one engine"
    health = client.get("/health").json()
    assert health["scale_ups"] >= 1 and first_s < WAIT_S
    metrics = client.get("/metrics").text
    assert "warmboot_fleet_scale_up_decision_seconds" in metrics
    name = "warmboot_fleet_scale_up_decision_seconds "
    decision = float(
        next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name))
    )
    assert 0 < decision < 5, f"the scale-up decision took {decision:.2f} s"
    wait_for(client, idle, "zero replicas after idle")


def test_a_burst_within_one_replicas_batch_boots_one(fleet):
    """No wasted boot: a burst that one replica's batch takes scales 0 -> 1, not 0 -> 1 -> 2."""
    cfg, client = fleet
    wait_for(client, idle, "zero replicas")
    before = client.get("/health").json()["scale_ups"]
    base = f"http://127.0.0.1:{PORT}"

    async def burst():
        return await asyncio.gather(*[stream(base, f"small {i}", 8) for i in range(2)])

    results = asyncio.run(burst())
    assert all(r["status"] == 200 and r["done"] for r in results), results
    assert len({r["replica"] for r in results}) == 1
    assert client.get("/health").json()["scale_ups"] == before + 1
    wait_for(client, idle, "zero replicas after the small burst")


def test_a_burst_scales_to_two_and_every_stream_completes_across_the_downscale(fleet):
    cfg, client = fleet
    wait_for(client, idle, "zero replicas")
    base = f"http://127.0.0.1:{PORT}"

    async def burst():
        # NOTE: more than one replica's batch (4) waits while the first boots (6: the bound)
        short = [stream(base, f"burst {i}", 60) for i in range(5)]
        long = stream(base, "the long one", 110)  # still running when the others' replica goes
        return await asyncio.gather(long, *short)

    seen = []

    def watch():
        import threading

        stop = threading.Event()

        def run():
            while not stop.wait(0.25):
                seen.append(replicas(client))

        threading.Thread(target=run, daemon=True).start()
        return stop

    stop = watch()
    try:
        results = asyncio.run(burst())
    finally:
        stop.set()
    assert all(r["status"] == 200 and r["done"] and not r["errors"] for r in results), results
    assert len(results[0]["text"]) > 0
    assert max(s["running"] + s["starting"] for s in seen) == 2, f"the burst wanted two: {seen}"
    assert_no_blocks_held(client)
    wait_for(client, idle, "zero replicas after the burst")


def assert_no_blocks_held(client) -> None:
    """Every live replica reports its KV blocks all free once its requests have ended."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        used = [
            float(line.split()[-1])
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("warmboot_kv_blocks_used")
        ]
        if used and all(u == 0 for u in used):
            return
        time.sleep(0.25)
    raise AssertionError(f"KV blocks still held after every request ended: {used}")


def test_the_queue_is_bounded_with_retry_after(fleet):
    cfg, client = fleet
    wait_for(client, idle, "zero replicas")
    base = f"http://127.0.0.1:{PORT}"

    async def flood():
        return await asyncio.gather(*[stream(base, f"q {i}", 4) for i in range(10)])

    results = asyncio.run(flood())
    busy = [r for r in results if r["status"] == 503]
    served = [r for r in results if r["status"] == 200]
    assert busy and all(r["retry_after"] for r in busy), results
    assert len(served) >= cfg.max_queued_requests - 2 and all(r["done"] for r in served)
    wait_for(client, idle, "zero replicas after the flood")


def test_shutdown_leaves_no_ray_process(fleet):
    """Last: the fleet stops, and no Ray or replica process outlives it."""
    from warmboot.fleet import app as fleet_app

    cfg, client = fleet
    fleet_app.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        left = [
            line
            for line in ps.splitlines()
            if "ray::" in line or "gcs_server" in line or "raylet" in line
        ]
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"still running after the fleet stopped: {left[:5]}")
