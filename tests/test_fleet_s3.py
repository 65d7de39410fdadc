"""The fleet with an S3 store (moto's server) through the node cache: the first replica
boots cold (in gVisor where runsc works), publishes and pushes; a replica on a node whose
cache is empty pulls the images and restores (tier P with an S3 store), answering the same."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
PORT = 18766
WAIT_S = 180.0


@pytest.fixture(scope="module")
def s3_fleet(path, s3_endpoint, tmp_path_factory):
    import httpx

    from warmboot.fleet import app as fleet_app
    from warmboot.fleet.config import AutoscalingConfig, FleetConfig
    from warmboot.launcher.sandbox import runsc_status

    cache = tmp_path_factory.mktemp("fleet-s3") / "node-cache"
    cfg = FleetConfig(
        model_id="tiny",
        model_source=str(path),
        engine_kwargs={"max_model_len": 128, "block_size": 4, "num_kv_blocks": 64},
        snapshot_store="s3://snaps/fleet",
        node_cache_dir=str(cache),
        sandbox="auto",
        autoscaling=AutoscalingConfig(min_replicas=0, max_replicas=1, downscale_delay_s=2),
    )
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=60)
    fleet_app.run_fleet(cfg, PORT, blocking=False)  # NOTE: after moto: replicas see its env
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=WAIT_S)
    yield cfg, client, cache, runsc_status()[0] is not None
    client.close()
    fleet_app.shutdown()


def _ask(client) -> str:
    body = {
        "model": "tiny",
        "prompt": "From S3",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _wait_idle(client) -> None:
    deadline = time.monotonic() + WAIT_S
    while any(client.get("/health").json()["replicas"].values()):
        assert time.monotonic() < deadline, "the fleet never went back to zero"
        time.sleep(0.25)


def _starts(client) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        starts = client.get("/health").json()["starts_by_path"]
        if starts:
            return starts
        time.sleep(0.25)
    return {}


def test_a_new_node_pulls_from_s3_and_restores(s3_fleet, path):
    from warmboot import LLM, SamplingParams
    from warmboot.snapshot.store import open_store

    cfg, client, cache, tier_p = s3_fleet
    first = _ask(client)
    assert _starts(client) == {"cold": 1}, client.get("/health").json()["starts"]
    keys = open_store(cfg.snapshot_store).list_keys()
    starts = client.get("/health").json()["starts"]
    assert any(k.startswith("process-") for k in keys) == tier_p, (keys, starts)
    _wait_idle(client)
    shutil.rmtree(cache)  # a fresh node: nothing local
    again = _ask(client)
    want = "restored_process" if tier_p else "restored_image"
    deadline = time.monotonic() + 20
    while _starts(client).get(want) != 1 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _starts(client).get(want) == 1, client.get("/health").json()["starts"]
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert first == again == llm.generate("From S3", params)[0].outputs[0].text
