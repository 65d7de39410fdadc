"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.helpers import hf_greedy
from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(path):
    llm = tiny_llm(path, max_num_seqs=16)
    with running_server(EngineHolder.ready(llm.engine), enable_debug=True) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _tokens(llm, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_greedy_matches_transformers(client, server, hf):
    _, llm = server
    prompt = "the cat sat on"
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, extra_body=NO_EOS
    )
    expected = hf_greedy(hf, _tokens(llm, prompt), 10)
    assert out.choices[0].text == llm.engine.tokenizer.decode(expected)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(_tokens(llm, prompt))
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_completion_stream_equals_non_stream_and_ends_with_usage(client):
    args = dict(model=MODEL_NAME, prompt="hello world", max_tokens=12, temperature=0)
    full = client.completions.create(**args, extra_body=NO_EOS).choices[0].text
    chunks = list(
        client.completions.create(
            **args, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert len([c for c in chunks if c.choices]) > 2, "tokens must stream"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_chat_matches_the_template_prompt(client, server, hf):
    _, llm = server
    messages = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    tok = llm.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert out.choices[0].message.content == tok.decode(hf_greedy(hf, prompt, 8))
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_n_and_seed_are_reproducible_across_calls(client):
    args = dict(model=MODEL_NAME, prompt="once upon", max_tokens=8, n=2, seed=1234)
    first = client.completions.create(**args, temperature=1.0, extra_body=NO_EOS)
    second = client.completions.create(**args, temperature=1.0, extra_body=NO_EOS)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text, "n choices must differ"
    assert first.usage.completion_tokens == 16
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=6)
    a = client.chat.completions.create(**chat, n=2, seed=7, extra_body=NO_EOS)
    b = client.chat.completions.create(**chat, n=2, seed=7, extra_body=NO_EOS)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_stop_sequence_cuts_the_text(client):
    args = dict(model=MODEL_NAME, prompt="a b c", max_tokens=24, temperature=0)
    full = client.completions.create(**args, extra_body=NO_EOS).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    out = client.completions.create(**args, stop=[stop], extra_body=NO_EOS).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    streamed = client.completions.create(**args, stop=stop, stream=True, extra_body=NO_EOS)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == out.text
    assert chunks[-1].finish_reason == "stop"


def test_logprobs_completions_and_chat(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="dog", max_tokens=5, temperature=0, logprobs=3, extra_body=NO_EOS
    ).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and sampled <= 0
        assert sampled == pytest.approx(max(top.values()), abs=1e-5), "greedy picks the top one"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "dog"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.bytes == list(item.token.encode())


def test_logit_bias_forces_a_token(client, server):
    _, llm = server
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"7": 100},
        extra_body=NO_EOS,
    )
    assert out.choices[0].text == llm.engine.tokenizer.decode([7] * 4)


def test_response_format_json_object_and_schema(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=60,
        temperature=0.7,
        seed=3,
        response_format={"type": "json_object"},
    ).choices[0]
    assert out.finish_reason == "stop", "the grammar must close the object"
    assert isinstance(json.loads(out.message.content), dict)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for seed in (1, 2):
        res = client.completions.create(
            model=MODEL_NAME,
            prompt="person:",
            max_tokens=60,
            temperature=0.8,
            seed=seed,
            extra_body={"response_format": fmt},
        ).choices[0]
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), schema)


def test_async_client_concurrent_streams(server):
    url, _ = server

    async def one(client, i: int) -> tuple[str, str]:
        args = dict(model=MODEL_NAME, prompt=f"item {i}", max_tokens=8, temperature=0)
        whole = (await client.completions.create(**args, extra_body=NO_EOS)).choices[0].text
        stream = await client.completions.create(**args, stream=True, extra_body=NO_EOS)
        parts = [c.choices[0].text async for c in stream if c.choices]
        return whole, "".join(parts)

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(6)))

    for whole, streamed in asyncio.run(main()):
        assert whole == streamed and whole


def test_metrics_report_requests_latency_and_start_path(client, server):
    client.completions.create(model=MODEL_NAME, prompt="m", max_tokens=3, extra_body=NO_EOS)
    import httpx

    text = httpx.get(server[0] + "/metrics").text
    assert 'warmboot_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "warmboot_time_to_first_token_seconds_count" in text
    assert "warmboot_inter_token_latency_seconds_count" in text
    assert 'warmboot_start_info{path="cold"' in text
    assert "warmboot_kv_cache_usage" in text and "warmboot_bubble_fraction" in text
    assert 'warmboot_cuda_graphs_info{state="off"} 1.0' in text  # a CPU engine
    assert "warmboot_graph_steps_total 0.0" in text
    assert "warmboot_time_to_ready_seconds" in text
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["start_path"] == "cold"
