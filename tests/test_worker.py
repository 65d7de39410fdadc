"""The worker protocol without a sandbox: frames, a real worker subprocess driven over its
stdio by ``RemoteLLM``, and the HTTP server in front of it."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.helpers import hf_greedy
from tests.server_harness import MODEL_NAME, running_server
from warmboot.core.errors import InvalidRequestError
from warmboot.launcher.frames import (
    FrameError,
    FrameWriter,
    OutputAccumulator,
    output_to_wire,
    params_from_wire,
    params_to_wire,
    read_frame,
)
from warmboot.launcher.remote import Channel, LaunchInfo, RemoteLLM, WorkerError
from warmboot.outputs import CompletionOutput, Logprob, RequestOutput
from warmboot.sampling_params import SamplingParams, StructuredOutputs
from warmboot.server.engine_holder import EngineHolder
from warmboot.tokenizer import Tokenizer


def test_a_deeply_nested_schema_crosses_the_wire_unchanged():
    """400 levels (the fairness bench's nested load): converted recursively it overflowed the
    stack, a 500 for what the worker refuses with a 400 naming the nesting limit."""
    schema: dict = {"type": "string"}
    for i in range(400):
        schema = {"type": "object", "properties": {f"k{i}": schema}}
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    for spec in (StructuredOutputs(json=schema), StructuredOutputs(structural_tag=tag)):
        params = SamplingParams(max_tokens=3, structured_outputs=spec)
        buf = io.BytesIO()
        FrameWriter(buf).send({"t": "add", "params": params_to_wire(params)})
        buf.seek(0)
        assert params_from_wire(read_frame(buf)["params"]) == params


def test_frames_round_trip_and_reject_garbage():
    buf = io.BytesIO()
    writer = FrameWriter(buf)
    writer.send({"t": "a", "x": [1, 2], "m": {3: "z"}})
    writer.send({"t": "b"})
    buf.seek(0)
    assert read_frame(buf) == {"t": "a", "x": [1, 2], "m": {3: "z"}}
    assert read_frame(buf) == {"t": "b"}
    assert read_frame(buf) is None
    with pytest.raises(FrameError, match="ended inside a frame"):
        read_frame(io.BytesIO(b"\x00\x00\x00\x09abc"))
    with pytest.raises(FrameError, match="exceeds the limit"):
        read_frame(io.BytesIO(b"\xff\xff\xff\xff"))


def test_params_and_outputs_cross_the_wire_unchanged():
    params = SamplingParams(
        n=2,
        temperature=0.5,
        stop=("x", "yy"),
        logprobs=2,
        seed=9,
        structured_outputs=StructuredOutputs(json={"type": "object"}),
    )
    assert params_from_wire(params_to_wire(params)) == params
    acc = OutputAccumulator("r", "p", [1, 2])
    steps = [([5], "he", None), ([6, 7], "llo", "stop")]
    for ids, text, reason in steps:
        lps = [{t: Logprob(-0.5, "tok"), t + 100: Logprob(-1.5, "alt")} for t in ids]
        sent = RequestOutput(
            "r",
            "p",
            [1, 2],
            [
                CompletionOutput(
                    0,
                    "ignored",
                    [5, 6, 7][: 1 + 2 * (reason is not None)],
                    reason,
                    None,
                    logprobs=lps if reason is None else [lps[0]] * 1 + lps,
                    delta_text=text,
                    delta_token_ids=ids,
                )
            ],
            finished=reason is not None,
        )
        got = acc.add(output_to_wire(sent))
    c = got.outputs[0]
    assert got.finished and c.text == "hello" and c.token_ids == [5, 6, 7]
    assert c.finish_reason == "stop" and len(c.logprobs) == 3
    assert c.logprobs[2][107].logprob == -1.5 and c.logprobs[2][7].decoded_token == "tok"


def _beating(frames: int, last: dict | None) -> Channel:
    """A channel whose worker sends a stats frame every 0.1 s (``frames`` of them), then
    ``last`` (if any), then nothing."""
    read_end, write_end = os.pipe()
    writer = FrameWriter(os.fdopen(write_end, "wb"))

    def beat() -> None:
        try:
            for _ in range(frames):
                writer.send({"t": "stats", "stats": {}})
                time.sleep(0.1)
            if last is not None:
                writer.send(last)
        except (OSError, ValueError):
            pass  # NOTE: the test is over and its channel closed

    threading.Thread(target=beat, daemon=True).start()
    return Channel(io.BytesIO(), os.fdopen(read_end, "rb"))


def test_expect_waits_while_frames_come_up_to_its_total():
    """A worker compiling before its checkpoint (minutes in gVisor) sends stats frames: each
    restarts the wait for ``quiescent``, and ``total`` still bounds the whole of it."""
    t0 = time.monotonic()
    assert _beating(8, {"t": "quiescent"}).expect("quiescent", 0.5)["t"] == "quiescent"
    assert time.monotonic() - t0 > 0.7, "longer than one timeout in all"
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="sent no 'quiescent' within 2s"):
        _beating(30, None).expect("quiescent", 0.5, total=1.5)
    assert 1.4 < time.monotonic() - t0 < 3


def _spawn(path, kv_blocks: int = 64):
    """A worker subprocess (no sandbox) after its ``started`` handshake, and its canary."""
    engine = {"model": str(path), "max_model_len": 128, "num_kv_blocks": kv_blocks}
    engine["block_size"] = 4
    cmd = [sys.executable, "-m", "warmboot.launcher.worker", json.dumps(engine)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    channel = Channel(proc.stdin, proc.stdout)
    channel.expect("booted", 120)
    channel.send({"t": "prepare_checkpoint"})
    canary = channel.expect("quiescent", 60)["canary"]
    channel.send({"t": "start", "seed": 5})
    started = channel.expect("started", 60)
    info = LaunchInfo("cold", "test worker")
    return RemoteLLM(channel, Tokenizer.from_dir(path), started, info), proc, canary, started


@pytest.fixture(scope="module")
def worker(path):
    client, proc, canary, started = _spawn(path)
    yield client, canary, started
    client.shutdown()
    assert proc.wait(timeout=30) == 0


def test_canary_survives_the_kv_shrink_and_regrow(worker):
    _, canary, started = worker
    assert len(canary) == 2 and canary == started["canary"]
    assert started["stats"]["kv_blocks_total"] == 64, "the KV pool is back to full size"


async def _run(client, prompt, params):
    stream = await client.add_request(prompt, params)
    outs = [o async for o in stream]
    return outs


def test_remote_requests_match_transformers(worker, hf):
    client, _, _ = worker
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = [5, 17, 33, 2, 9]
    outs = asyncio.run(_run(client, {"prompt_token_ids": prompt}, params))
    final = outs[-1].outputs[0]
    assert final.token_ids == hf_greedy(hf, prompt, 10)
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert len(final.logprobs) == 10 and len(outs) > 1


def test_remote_output_kinds(worker, hf):
    """Only deltas cross the pipe; the launcher hands each request the kind it asked for."""
    client, _, _ = worker
    prompt = [5, 17, 33, 2, 9]
    ref = hf_greedy(hf, prompt, 8)
    got = {}
    for kind in ("cumulative", "delta", "final"):
        params = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, output_kind=kind
        )
        got[kind] = asyncio.run(_run(client, {"prompt_token_ids": prompt}, params))
    cumulative, delta, (final,) = got["cumulative"], got["delta"], got["final"]
    assert [o.outputs[0].token_ids for o in cumulative] == [ref[: i + 1] for i in range(8)]
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in ref]
    assert [len(o.outputs[0].logprobs) for o in delta] == [1] * 8
    assert final.finished and final.outputs[0].token_ids == ref
    assert final.outputs[0].text == cumulative[-1].outputs[0].text
    assert final.outputs[0].text == "".join(o.outputs[0].text for o in delta)
    assert final.outputs[0].logprobs == cumulative[-1].outputs[0].logprobs


def test_remote_concurrent_requests_share_step_frames(worker, hf):
    """A step's outputs cross the pipe as one frame; each stream still gets its own."""
    client, _, _ = worker
    prompts = [[5, 17, 33, 2, 9], [7, 7, 1], [40, 3, 8, 12], [11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="delta")
    frames = []
    deliver = client._deliver_outputs

    def spy(items):
        frames.append(len(items))
        deliver(items)

    client._deliver_outputs = spy
    try:

        async def main():
            jobs = [_run(client, {"prompt_token_ids": p}, params) for p in prompts]
            return await asyncio.gather(*jobs)

        results = asyncio.run(main())
    finally:
        del client._deliver_outputs
    for p, outs in zip(prompts, results, strict=True):
        assert [t for o in outs for t in o.outputs[0].token_ids] == hf_greedy(hf, p, 6)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(frames) == sum(len(outs) for outs in results)
    assert max(frames) == len(prompts), "steps with all four running share one frame"


def test_remote_rejects_bad_requests_and_aborts(worker):
    client, _, _ = worker

    async def main():
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await client.add_request("hi", SamplingParams(max_tokens=1000))
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        stream = await client.add_request("abort me", long)
        await stream.__anext__()
        stream.abort()
        return await client.debug_state()

    state = asyncio.run(main())
    deadline_state = state
    for _ in range(50):
        if not deadline_state["unfinished"]:
            break
        deadline_state = asyncio.run(client.debug_state())
    assert deadline_state["invariants_ok"] and not deadline_state["unfinished"]
    assert deadline_state["kv_blocks_used"] == 0


def test_http_server_in_front_of_a_worker(worker):
    client, _, _ = worker
    holder = EngineHolder(lambda: client)
    holder.boot()
    holder.shutdown = lambda: None  # the fixture owns the worker
    with running_server(holder, enable_debug=True) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        args = dict(model=MODEL_NAME, prompt="hi", max_tokens=6, temperature=0)
        whole = api.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
        parts = api.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in parts if c.choices) == whole
        assert httpx.get(url + "/health").json()["start_path"] == "cold"
        assert httpx.get(url + "/debug/engine").json()["invariants_ok"]
        assert "warmboot_kv_blocks_capacity 64.0" in httpx.get(url + "/metrics").text


def test_launch_keeps_tier_p_off_where_it_cannot_work(path):
    """A remote store (no network in the sandbox) or a GPU host (this runsc has no GPU
    support): the engine boots in-process and says why."""
    from warmboot.launcher.launch import LaunchConfig, launch
    from warmboot.launcher.local import wants_gpu

    engine = {"model": str(path), "max_model_len": 64, "num_kv_blocks": 32}
    client = launch(LaunchConfig(engine=engine, store="s3://bucket/prefix"))
    try:
        assert client.start_info.path == "cold"
        assert "need a local store" in client.start_info.reason
    finally:
        client.shutdown()
    assert wants_gpu({**engine, "device": "cuda:0"})
    assert not wants_gpu({**engine, "device": "cpu"})


def test_a_dead_worker_is_replaced(path):
    """The worker dies (killed): requests get a 503 that says so while a new one boots,
    then the replica answers again, and /metrics counts the restart."""
    procs = []

    def boot():
        client, proc, _, _ = _spawn(path, kv_blocks=32)
        procs.append(proc)
        return client

    holder = EngineHolder(boot)
    holder.boot()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    with running_server(holder) as url:
        first = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
        procs[0].kill()
        procs[0].wait()
        statuses = []
        for _ in range(600):
            resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
            statuses.append(resp.status_code)
            if resp.status_code == 200:
                break
            assert resp.status_code == 503, resp.text
            time.sleep(0.05)
        assert statuses[-1] == 200 and 503 in statuses, statuses
        assert resp.json()["choices"][0]["text"] == first
        assert len(procs) == 2 and holder.restarts == 1
        assert "warmboot_engine_restarts_total 1.0" in httpx.get(url + "/metrics").text


def test_a_module_in_the_working_directory_does_not_shadow_the_worker(tmp_path):
    """The launcher starts the worker with ``-P``: a json.py where the server runs is not
    imported in place of the standard library's."""
    from warmboot.launcher.launch import LaunchConfig, worker_spec

    (tmp_path / "json.py").write_text('raise SystemExit("shadowed")\n')
    argv = worker_spec(LaunchConfig(engine={"bad": 1}, work_dir=tmp_path / "w")).argv
    done = subprocess.run(
        [*argv[:-1], "{}"], cwd=tmp_path, capture_output=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert b"shadowed" not in done.stderr + done.stdout
    assert b"fatal" in done.stdout  # it ran and reported the bad settings as a frame
