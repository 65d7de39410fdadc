"""LoRA adapters through the server, driven by the official ``openai`` client as vLLM documents
them: ``--lora-modules`` (both forms), a request's ``model`` naming an adapter or the base
(greedy tokens as ``LLM.generate(..., lora_request=...)`` offline), ``/v1/models``' shape, an
unknown name a 404, runtime ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (on
only with the variable set; a bad load a 400 naming the problem; an unloaded adapter's
running request finishes), in process and through a worker process, and the engine serving
on after each error."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.lora_adapters import make_adapter, peft_missing
from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot import LoRARequest, SamplingParams
from warmboot.server.adapters import (
    RUNTIME_ENV,
    ServedAdapters,
    parse_lora_modules,
    runtime_updates_allowed,
)
from warmboot.server.engine_holder import EngineHolder

pytestmark = pytest.mark.skipif(peft_missing() is not None, reason=str(peft_missing()))

PROMPT = "the cat sat on"
CHAT = [{"role": "user", "content": "hi there"}]
MAX_NEW = 8
LONG = 160
NO_EOS = {"ignore_eos": True}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=True)


@pytest.fixture(scope="module")
def refs(path, tmp_path_factory):
    """Three adapters of the tiny Llama (one too big for max_lora_rank=8) and what an offline
    ``LLM`` generates with each and the base: completion and chat texts."""
    root = tmp_path_factory.mktemp("lora-server")
    adapters = {
        "alpha": make_adapter(root / "alpha", path, r=4, std=0.5),
        "beta": make_adapter(root / "beta", path, r=8, target_modules=ALL_LINEAR, std=0.5),
        "gamma": make_adapter(root / "gamma", path, r=2, seed=2, std=0.5),
        "big": make_adapter(root / "big", path, r=16, seed=3),
    }
    llm = tiny_llm(path, **LORA)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    texts = {}
    for i, name in enumerate([None, "alpha", "beta", "gamma"]):
        lora = None if name is None else LoRARequest(name, i, str(adapters[name]))
        texts[name] = (
            llm.generate(PROMPT, greedy, lora_request=lora)[0].outputs[0].text,
            llm.chat(CHAT, greedy, lora_request=lora)[0].outputs[0].text,
            llm.generate(PROMPT, long, lora_request=lora)[0].outputs[0].text,
        )
    llm.close()
    assert len({t[0] for t in texts.values()}) == 4, "every adapter changes the output"
    return adapters, texts


def _modules(adapters) -> tuple[str, ...]:
    beta = {"name": "beta", "path": str(adapters["beta"]), "base_model_name": "org/tiny"}
    return (f"alpha={adapters['alpha']}", json.dumps(beta))


@pytest.fixture(scope="module")
def server(path, refs):
    adapters, _ = refs
    llm = tiny_llm(path, **LORA)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RUNTIME_ENV, "1")
        serving = running_server(EngineHolder.ready(llm.engine), lora_modules=_modules(adapters))
        with serving as url:
            env.delenv(RUNTIME_ENV)
            yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _complete(client, model: str, **kw):
    args = dict(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0) | kw
    return client.completions.create(**args, extra_body=NO_EOS)


def _chat(client, model: str):
    return client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_NEW, temperature=0, extra_body=NO_EOS
    )


def _serves_on(client, refs) -> None:
    """The base and an adapter still answer as offline."""
    _, texts = refs
    assert _complete(client, MODEL_NAME).choices[0].text == texts[None][0]
    assert _complete(client, "alpha").choices[0].text == texts["alpha"][0]


def test_adapters_and_base_match_offline(client, refs):
    _, texts = refs
    for name, model in ((None, MODEL_NAME), ("alpha", "alpha"), ("beta", "beta")):
        out = _complete(client, model)
        assert out.choices[0].text == texts[name][0], f"{model}: completion differs"
        assert out.model == model
        chat = _chat(client, model)
        assert chat.choices[0].message.content == texts[name][1], f"{model}: chat differs"
    stream = client.chat.completions.create(
        model="beta", messages=CHAT, max_tokens=MAX_NEW, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == texts["beta"][1]


def test_models_list_the_base_and_each_adapter(client, server, refs):
    adapters, _ = refs
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "alpha", "beta"]
    cards = {c["id"]: c for c in httpx.get(server[0] + "/v1/models").json()["data"]}
    assert cards["alpha"]["parent"] == MODEL_NAME and cards["alpha"]["root"] == str(
        adapters["alpha"]
    )
    assert cards["beta"]["parent"] == "org/tiny"  # NOTE: vLLM's base_model_name
    assert cards[MODEL_NAME]["parent"] is None
    assert client.models.retrieve("beta").id == "beta"


def test_an_unknown_model_is_a_404(client, server, refs):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope")
    error = e.value.body
    assert error["code"] == "model_not_found" and "'alpha'" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    _serves_on(client, refs)


def _post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def test_runtime_load_serve_and_unload(client, server, refs, tmp_path):
    url, _ = server
    adapters, texts = refs
    load = _post(url, "/v1/load_lora_adapter", lora_name="gamma", lora_path=str(adapters["gamma"]))
    assert load.status_code == 200 and "gamma" in load.text
    assert _complete(client, "gamma").choices[0].text == texts["gamma"][0]
    assert "gamma" in [m.id for m in client.models.list().data]
    huge = {"prompt": "word " * 40_000, "max_tokens": 1}  # NOTE: screened in a child process
    screened = httpx.post(url + "/v1/completions", json=huge | {"model": "gamma"}, timeout=60)
    assert screened.status_code == 400 and "max_model_len" in screened.text, screened.text
    bad = {
        "already been loaded": dict(lora_name="alpha", lora_path=str(adapters["gamma"])),
        "base model's name": dict(lora_name=MODEL_NAME, lora_path=str(adapters["gamma"])),
        "not a directory": dict(lora_name="gone", lora_path=str(tmp_path / "missing")),
        "max_lora_rank": dict(lora_name="big", lora_path=str(adapters["big"])),
    }
    for words, body in bad.items():
        resp = _post(url, "/v1/load_lora_adapter", **body)
        assert resp.status_code == 400, resp.text
        assert words in resp.json()["error"]["message"]
        _serves_on(client, refs)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "alpha", "beta", "gamma"]
    assert _post(url, "/v1/unload_lora_adapter", lora_name="gamma").status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "gamma")
    missing = _post(url, "/v1/unload_lora_adapter", lora_name="gamma")
    assert missing.status_code == 404 and "gamma" in missing.json()["error"]["message"]
    _serves_on(client, refs)


def test_an_unload_lets_running_requests_finish(client, server, refs):
    url, llm = server
    adapters, texts = refs
    load = _post(url, "/v1/load_lora_adapter", lora_name="delta", lora_path=str(adapters["alpha"]))
    assert load.status_code == 200
    stream = _complete(client, "delta", max_tokens=LONG, stream=True)
    parts = [next(stream).choices[0].text]
    assert _post(url, "/v1/unload_lora_adapter", lora_name="delta").status_code == 200
    assert "delta" in {r.lora for r in llm.engine.scheduler.requests.values()}, "still running"
    parts += [c.choices[0].text for c in stream if c.choices]
    assert "".join(parts) == texts["alpha"][2]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "delta")
    _serves_on(client, refs)


def test_runtime_updates_are_off_without_the_variable_and_behind_the_key(monkeypatch):
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    holder = EngineHolder(lambda: None)  # NOTE: never booted: the refusals come first
    with running_server(holder, api_key="key") as url:
        body = {"lora_name": "x", "lora_path": "/x"}
        assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
        auth = {"authorization": "Bearer key"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            resp = httpx.post(
                url + path, json=body if "un" not in path else {"lora_name": "x"}, headers=auth
            )
            assert resp.status_code == 403 and RUNTIME_ENV in resp.json()["error"]["message"]
    assert runtime_updates_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updates_allowed({RUNTIME_ENV: "1"})
    assert not runtime_updates_allowed({RUNTIME_ENV: "0"})


def test_lora_modules_on_the_command_line(path, capsys):
    from warmboot.cli import build_parser, main, server_settings

    beta = '{"name": "beta", "path": "/b", "base_model_name": "org/tiny"}'
    words = ["serve", "--model", str(path), "--enable-lora", "--lora-modules", "alpha=a", beta]
    config, _ = server_settings(build_parser().parse_args(words), None)
    assert config.lora_modules == ("alpha=a", beta)
    alpha, parsed_beta = parse_lora_modules(config.lora_modules, config.served_model_name)
    assert (alpha.lora_name, alpha.lora_int_id, alpha.lora_path[0]) == ("alpha", 1, "/")
    assert alpha.lora_path.endswith("/a") and alpha.base_model_name is None
    assert parsed_beta == LoRARequest("beta", 2, "/b", "org/tiny")
    assert ServedAdapters("m", [alpha, parsed_beta]).lora_request("beta") is parsed_beta
    refused = {
        "needs --enable-lora": ["--lora-modules", "a=/a"],
        "use NAME=PATH": ["--enable-lora", "--lora-modules", "a"],
        "given twice": ["--enable-lora", "--lora-modules", "a=/a", "a=/b"],
        "base model's name": ["--enable-lora", "--lora-modules", f"{path.name}=/a"],
        "use the fields name, path": ["--enable-lora", "--lora-modules", '{"name": "a", "x": 1}'],
        "not valid JSON": ["--enable-lora", "--lora-modules", "{name"],
    }
    base = ["serve", "--model", str(path), "--engine-process", "off", "--sandbox", "none"]
    for words, extra in refused.items():
        assert main(base + extra) == 2
        assert words in capsys.readouterr().err


def test_a_bad_lora_module_fails_the_start(path, tmp_path):
    """``serve`` exits 2 naming the adapter once the engine has booted and read it."""
    bad = f"bad={tmp_path / 'missing'}"
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(path), "--port", "0"]
    cmd += ["--sandbox", "none", "--engine-process", "off", "--max-model-len", "64"]
    cmd += ["--enable-lora", "--lora-modules", bad]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert f"--lora-modules {bad}: " in line and "not a directory" in line, run.stderr
    assert "Traceback" not in run.stderr


# -- through a worker process ------------------------------------------------------------------
@contextmanager
def _worker(path):
    """A worker subprocess (no sandbox) with LoRA on, as ``RemoteLLM``."""
    from warmboot.launcher.remote import Channel, LaunchInfo, RemoteLLM
    from warmboot.tokenizer import Tokenizer

    engine = {"model": str(path), "max_model_len": 256, "block_size": 4, "num_kv_blocks": 128}
    engine |= {"cpu_threads": 1} | LORA
    cmd = [sys.executable, "-m", "warmboot.launcher.worker", json.dumps(engine)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    channel = Channel(proc.stdin, proc.stdout)
    try:
        channel.expect("booted", 120)
        channel.send({"t": "start", "seed": 0, "canary": False})
        started = channel.expect("started", 60)
        yield RemoteLLM(channel, Tokenizer.from_dir(path), started, LaunchInfo("cold", "test"))
    finally:
        channel.close()
        proc.wait(timeout=30)


def test_adapters_through_a_worker(path, refs, tmp_path):
    adapters, texts = refs
    with _worker(path) as remote:

        async def bad_adapter():
            bad = LoRARequest("gone", 9, str(tmp_path / "missing"))
            with pytest.raises(ValueError, match="not a directory"):
                await remote.add_request(PROMPT, SamplingParams(max_tokens=2), lora_request=bad)
            with pytest.raises(ValueError, match="not a directory"):
                await remote.add_lora(bad)
            with pytest.raises(KeyError):
                await remote.remove_lora("gone")

        asyncio.run(bad_adapter())
        holder = EngineHolder(lambda: remote)
        with pytest.MonkeyPatch.context() as env:
            env.setenv(RUNTIME_ENV, "1")
            with running_server(holder, lora_modules=_modules(adapters)) as url:
                holder.boot()
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                _serves_on(client, refs)
                assert _chat(client, "beta").choices[0].message.content == texts["beta"][1]
                body = dict(lora_name="gamma", lora_path=str(adapters["gamma"]))
                assert _post(url, "/v1/load_lora_adapter", **body).status_code == 200
                assert _complete(client, "gamma").choices[0].text == texts["gamma"][0]
                assert _post(url, "/v1/unload_lora_adapter", lora_name="gamma").status_code == 200
                with pytest.raises(openai.NotFoundError):
                    _complete(client, "gamma")
                _serves_on(client, refs)
