"""Every error the API promises: OpenAI's error shape, the right status, and a server that
still answers a good request afterwards."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.engine.async_llm import AsyncLLM
from warmboot.launcher.remote import LaunchInfo
from warmboot.server.engine_holder import EngineHolder

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def url(path):
    llm = tiny_llm(path)
    with running_server(EngineHolder.ready(llm.engine), max_body_bytes=20_000) as base:
        yield base


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def _still_serves(url: str) -> None:
    resp = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("patch", "param", "words"),
    [
        ({"temperature": 5}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"logprobs": 9}, "logprobs", "less than or equal to 5"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"max_tokens": 100_000}, None, "exceeds max_model_len"),
        ({"prompt": ""}, None, "empty"),
        ({"prompt": [10**9]}, None, "token ids"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias", "outside [-100, 100]"),
        ({"logit_bias": {"1000000": 1.0}}, None, "outside the vocabulary"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"best_of": 3}, "best_of", "not supported"),
        ({"prompt": None}, "prompt", "valid"),
    ],
)
def test_bad_parameters_are_400_naming_the_problem(url, patch, param, words):
    err = _error(httpx.post(url + "/v1/completions", json={**GOOD, **patch}), 400)
    assert err["type"] == "invalid_request_error"
    assert words in err["message"]
    if param is not None:
        assert err["param"] == param
    _still_serves(url)


def test_invalid_json_and_missing_fields(url):
    headers = {"content-type": "application/json"}
    err = _error(httpx.post(url + "/v1/completions", content=b"{not json", headers=headers), 400)
    assert "not valid JSON" in err["message"]
    err = _error(httpx.post(url + "/v1/chat/completions", json={"model": MODEL_NAME}), 400)
    assert err["param"] == "messages"
    err = _error(httpx.post(url + "/v1/chat/completions", json={**GOOD, "messages": []}), 400)
    assert err["param"] == "messages"
    _still_serves(url)


def test_invalid_schema_and_unsupported_chat_features(url):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}
    err = _error(
        httpx.post(url + "/v1/chat/completions", json={**chat, "response_format": bad_schema}), 400
    )
    assert "structured_outputs" in err["message"]
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    err = _error(
        httpx.post(url + "/v1/chat/completions", json={**chat, "response_format": no_schema}), 400
    )
    assert err["param"] == "response_format"
    tools = [{"type": "function", "function": {"description": "no name"}}]  # a malformed tool
    err = _error(httpx.post(url + "/v1/chat/completions", json={**chat, "tools": tools}), 400)
    assert err["param"] == "tools"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    msg = {**chat, "messages": [{"role": "user", "content": image}]}
    err = _error(httpx.post(url + "/v1/chat/completions", json=msg), 400)
    assert "image_url" in err["message"]
    _still_serves(url)


def test_unknown_model_is_404(url):
    err = _error(httpx.post(url + "/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    _still_serves(url)


def test_body_too_large_is_413(url):
    big = {**GOOD, "prompt": "x " * 20_000}
    err = _error(httpx.post(url + "/v1/completions", json=big), 413)
    assert "exceeds the limit of 20000 bytes" in err["message"]

    def chunked():  # no Content-Length: the limit must hold for a streamed body too
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}'

    headers = {"content-type": "application/json"}
    _error(httpx.post(url + "/v1/completions", content=chunked(), headers=headers), 413)
    _still_serves(url)


def test_unknown_route_and_method(url):
    _error(httpx.get(url + "/v1/nothing"), 404)
    _error(httpx.get(url + "/v1/completions"), 405)


def test_api_key_required_when_set(path):
    llm = tiny_llm(path)
    with running_server(EngineHolder.ready(llm.engine), api_key="s3cret") as base:
        err = _error(httpx.post(base + "/v1/completions", json=GOOD), 401)
        assert err["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        _error(httpx.post(base + "/v1/completions", json=GOOD, headers=wrong), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="bad", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(**GOOD).choices[0].text
        assert httpx.get(base + "/health").status_code == 200, "health stays open for probes"


def test_503_until_the_engine_is_ready(path):
    release = threading.Event()

    def slow_boot():
        release.wait(30)
        return AsyncLLM(tiny_llm(path).engine)

    holder = EngineHolder(slow_boot)
    holder.start()
    with running_server(holder) as base:
        assert httpx.get(base + "/health").status_code == 503
        err = _error(httpx.post(base + "/v1/completions", json=GOOD), 503)
        assert "starting" in err["message"]
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        _still_serves(base)
        assert "warmboot_ready 1.0" in httpx.get(base + "/metrics").text
        holder.llm.start_info_override = LaunchInfo("cold", "test", fallbacks=("canary_mismatch",))
        metrics = httpx.get(base + "/metrics").text
        assert 'warmboot_start_fallbacks_total{kind="canary_mismatch"} 1.0' in metrics


def test_failed_boot_reports_the_reason(tmp_path):
    holder = EngineHolder(lambda: tiny_llm(tmp_path / "missing").engine)
    holder.boot()
    with running_server(holder) as base:
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        err = _error(httpx.post(base + "/v1/completions", json=GOOD), 503)
        assert "does not exist" in err["message"]


def test_a_server_holder_freezes_the_booted_engine_for_the_collector(path):
    """With ``freeze_gc`` (what ``warmboot serve`` uses) the booted engine's objects leave the
    collector's scans; a replacement boot unfreezes first, so the old engine is freed."""
    import gc
    import weakref

    assert gc.get_freeze_count() == 0
    try:
        holder = EngineHolder(lambda: tiny_llm(path).engine, freeze_gc=True)
        holder.boot()
        assert gc.get_freeze_count() > 10_000
        first = weakref.ref(holder.llm)
        holder.boot()  # as a restart does
        gc.collect()
        assert first() is None, "the replaced engine stayed frozen"
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self):
        self.me = self


def _compile_in_background(made: list) -> None:
    """A background ``ModelCompile`` whose "compile" leaves ``made`` alive and a cycle dead."""
    import contextlib
    import weakref
    from types import SimpleNamespace

    from warmboot.device.compiled import CompileStats
    from warmboot.device.step_choice import StepChoice
    from warmboot.engine.background_compile import ModelCompile

    def build(kernel):
        made.extend(object.__new__(_Cycle) for _ in range(5000))  # NOTE: tracked, alive
        made.append(weakref.ref(_Cycle()))  # the compile's garbage: a dead cycle
        return SimpleNamespace(linears=None, stats=CompileStats())

    stream = SimpleNamespace(lend_helpers=lambda n: None, idle_seconds=lambda: 60.0)
    runner = SimpleNamespace(build_compiled=build, install_compiled=lambda s: None, stream=stream)
    job = ModelCompile(lambda name, **kw: contextlib.nullcontext(), 0.0)
    job.start(runner, None, background=True, recorded=StepChoice(mode="eager"))
    assert job.wait(60) and job.info["background"], job.info


def test_a_background_compile_keeps_a_frozen_heap_frozen():
    """Where the booted heap was frozen (a server's engine), what a background compile leaves
    alive is frozen too once it ends (no full-collection stalls over dynamo's objects), after
    a collection (its garbage is freed, not frozen); elsewhere nothing is frozen."""
    import gc

    offline: list = []
    _compile_in_background(offline)
    assert gc.get_freeze_count() == 0, "an offline engine's heap is left as it is"
    try:
        gc.freeze()
        before, made = gc.get_freeze_count(), []
        _compile_in_background(made)
        # NOTE: not + 5000 exactly: frozen objects of earlier tests may die meanwhile (22 did
        # in one CI run); without the freeze the count would not grow at all
        assert gc.get_freeze_count() >= before + 4000
        assert made[-1]() is None, "the compile's garbage was frozen, not collected"
    finally:
        gc.unfreeze()
