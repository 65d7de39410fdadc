"""The fleet's parts without Ray: the config's LLMConfig shape, the node cache in front of an
S3 store (pull, push, eviction), one publisher per model across replicas, and a stream whose
replica goes away ending with an error event."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from warmboot.fleet.config import AutoscalingConfig, FleetConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_config_takes_the_llm_config_shape_and_names_what_it_does_not_know():
    cfg = FleetConfig.from_llm_config(
        {
            "model_loading_config": {"model_id": "m", "model_source": "/models/m"},
            "engine_kwargs": {"dtype": "bfloat16"},
            "deployment_config": {
                "autoscaling_config": {"min_replicas": 0, "max_replicas": 3},
                "max_queued_requests": 7,
                "graceful_shutdown_timeout_s": 9,
            },
            "snapshot_store": "s3://b/p",
        }
    )
    assert (cfg.model_id, cfg.autoscaling.max_replicas, cfg.max_queued_requests) == ("m", 3, 7)
    assert cfg.drain_timeout_s == 9 and FleetConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(
        ValueError, match="unsupported deployment_config keys: \\['num_replicas'\\]"
    ):
        FleetConfig.from_llm_config(
            {
                "model_loading_config": {"model_source": "/m"},
                "deployment_config": {"num_replicas": 2},
            }
        )
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscalingConfig(min_replicas=3, max_replicas=2)
    from warmboot.fleet.app import build_openai_app

    with pytest.raises(ValueError, match="one model"):
        build_openai_app({"llm_configs": []})


@pytest.fixture
def remote(s3_endpoint, request):
    from warmboot.snapshot.store import open_store

    return open_store(f"s3://snaps/{request.node.name}")


def test_the_node_cache_pulls_only_what_it_lacks_and_pushes_what_was_published(
    path, remote, tmp_path
):
    from warmboot import LLM
    from warmboot.fleet.node_cache import NodeCache

    cache = NodeCache(remote, tmp_path / "cache", max_bytes=1 << 30)
    assert cache.pull(path) == []  # nothing of this model anywhere yet
    LLM(str(path), max_model_len=128, snapshot_store=cache.url)  # cold: publishes into the cache
    (key,) = cache.push(path)
    assert remote.list_keys() == [key] and cache.push(path) == []
    other = NodeCache(remote, tmp_path / "node2", max_bytes=1 << 30)
    assert other.pull(path) == [key]
    assert set(other.local.list_chunks()) == set(remote.list_chunks())
    llm = LLM(str(path), max_model_len=128, snapshot_store=other.url)
    assert llm.engine.start_info.path == "restored_image", llm.engine.start_info.reason


def test_the_node_cache_evicts_the_least_recently_used_but_never_what_this_start_uses(
    path, remote, tmp_path
):
    import os

    from warmboot import LLM
    from warmboot.fleet.node_cache import NodeCache

    cache = NodeCache(remote, tmp_path / "cache", max_bytes=1 << 30)
    LLM(str(path), max_model_len=128, snapshot_store=cache.url)
    LLM(str(path), max_model_len=96, snapshot_store=cache.url)  # a second key, other chunks
    old, new = sorted(cache.local.list_keys())
    os.utime(cache.local.root / "manifests" / f"{old}.json", (1, 1))  # used long ago
    cache.max_bytes = 1
    cache.evict(keep={new})
    assert cache.local.list_keys() == [new]


def test_a_failed_push_is_tried_again_and_never_fails_the_booted_replica(path, remote, tmp_path):
    from warmboot import LLM
    from warmboot.fleet import replica
    from warmboot.fleet.node_cache import NodeCache

    cache = NodeCache(remote, tmp_path / "cache", max_bytes=1 << 30)
    LLM(str(path), max_model_len=128, snapshot_store=cache.url)
    real, calls = cache.push, []

    def flaky(model_dir):
        calls.append(model_dir)
        if len(calls) == 1:
            raise ConnectionError("store went away")
        return real(model_dir)

    cache.push = flaky
    note = replica._push(cache, path)
    assert len(calls) == 2 and note.startswith("pushed [") and remote.list_keys(), note
    cache.push = lambda model_dir: (_ for _ in ()).throw(ConnectionError("still away"))
    note = replica._push(cache, path)
    assert note == f"push to {remote.url} failed: still away", note


def test_one_replica_of_many_publishes_a_new_model(path, remote, tmp_path):
    """Replicas starting together on a store without this model: one holds the fleet's
    publish lease and publishes; the others boot without publishing."""
    from warmboot.fleet import replica

    cfg = FleetConfig(
        model_id="m",
        model_source=str(path),
        snapshot_store=remote.url,
        node_cache_dir=str(tmp_path / "cache"),
    )
    barrier, got = threading.Barrier(4), []

    def start():
        barrier.wait()
        got.append(replica._prepare_store(cfg))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    leases = [lease for _, _, lease, _ in got if lease is not None]
    assert len(leases) == 1, got
    assert sum("not publishing" in why for *_, why in got) == 3


def test_a_stream_whose_replica_goes_away_ends_with_an_error_event():
    pytest.importorskip("ray.serve")
    from warmboot.fleet.ingress import _body

    class Gone:
        def __init__(self):
            self.items = [b'data: {"choices": []}\n\n']

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.items:
                return self.items.pop()
            raise RuntimeError("ActorDiedError: the replica was stopped")

        def cancel(self):
            pass

    async def collect(sse):
        return [c async for c in _body(Gone(), sse)]

    chunks = asyncio.run(collect(True))
    tail = b"".join(chunks[1:]).decode()
    error = json.loads(tail.split("\n\n")[0].removeprefix("data: "))
    assert error["error"]["code"] == 503 and tail.endswith("data: [DONE]\n\n")
    assert asyncio.run(collect(False)) == chunks[:1], "a non-SSE body just ends"


def test_joining_a_ray_address_that_does_not_answer_fails_fast():
    pytest.importorskip("ray")
    import socket
    import time

    from warmboot.fleet.app import start_ray

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = FleetConfig(model_id="m", model_source="/m")
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} does not answer"):
        start_ray(cfg, address=f"ray://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 15


def test_the_ingress_checks_the_api_key():
    pytest.importorskip("ray.serve")
    import types

    from starlette.requests import Request

    from warmboot.fleet.ingress import Ingress

    fake = types.SimpleNamespace(cfg=FleetConfig(model_id="m", model_source="/m", api_key="k1"))

    def request(auth: str | None) -> Request:
        headers = [(b"authorization", auth.encode())] if auth is not None else []
        return Request({"type": "http", "headers": headers})

    assert Ingress._denied(fake, request("Bearer k1")) is None
    assert Ingress._denied(fake, request("bearer k1")) is None
    for bad in ("Bearer k2", "Basic k1", "", None):
        assert Ingress._denied(fake, request(bad)).status_code == 401, bad
    open_fleet = types.SimpleNamespace(cfg=FleetConfig(model_id="m", model_source="/m"))
    assert Ingress._denied(open_fleet, request(None)) is None
