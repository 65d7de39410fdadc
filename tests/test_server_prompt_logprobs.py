"""Prompt log-probabilities over HTTP: ``echo`` + ``logprobs`` and ``max_tokens=0`` in
``/v1/completions`` (what lm-eval's ``local-completions`` sends to score a continuation), and
vLLM's ``prompt_logprobs`` extension in both endpoints. Values come from transformers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.helpers import hf_logits
from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

TOL = 1e-4


@pytest.fixture(scope="module")
def server(path):
    llm = tiny_llm(path, max_num_seqs=8, max_num_batched_tokens=16)  # chunked prefill
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _ref(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, ids).double(), dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(client, server, hf, max_tokens):
    """lm-eval reads ``token_logprobs[ctxlen:-1]`` of such a response: every prompt token
    after the first is scored as transformers scores it."""
    _, llm = server
    text = "the quick brown fox jumps over the lazy dog"
    ids = llm.engine.tokenizer.encode(text)
    out = client.completions.create(
        model=MODEL_NAME, prompt=text, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    )
    (choice,) = out.choices
    lp = choice.logprobs
    ref = _ref(hf, ids)
    assert choice.text.startswith(text)
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < TOL, f"token {i}"
        assert len(lp.top_logprobs[i]) <= 2
        best = max(lp.top_logprobs[i].values())
        assert abs(best - float(ref[i - 1].max())) < TOL
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])
    if max_tokens == 0:
        assert choice.text == text and choice.finish_reason == "length"
        assert out.usage.completion_tokens == 0
    else:
        assert abs(lp.token_logprobs[-1] - float(ref[-1].max())) < TOL  # greedy
        assert out.usage.completion_tokens == 1


def test_token_prompts_and_streaming(server, hf):
    url, llm = server
    ids = llm.engine.tokenizer.encode("a b c d e f g h i j k l")
    body = {
        "model": MODEL_NAME,
        "prompt": [ids, ids[:5]],
        "echo": True,
        "logprobs": 0,
        "max_tokens": 0,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    by_index = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            by_index.setdefault(ch["index"], []).append(ch)
    assert sorted(by_index) == [0, 1]
    for index, prompt in ((0, ids), (1, ids[:5])):
        (only,) = by_index[index]  # the prompt is all: one chunk, finished
        assert only["finish_reason"] == "length"
        got = only["logprobs"]["token_logprobs"]
        ref = _ref(hf, prompt)
        assert got[0] is None and len(got) == len(prompt)
        assert all(abs(got[i] - float(ref[i - 1, prompt[i]])) < TOL for i in range(1, len(got)))


def test_vllm_prompt_logprobs_extension(client, server, hf):
    _, llm = server
    ids = llm.engine.tokenizer.encode("one two three four")
    out = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    plp = out.choices[0].model_extra["prompt_logprobs"]
    ref = _ref(hf, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert abs(plp[i][str(ids[i])]["logprob"] - float(ref[i - 1, ids[i]])) < TOL
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=1,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"prompt_logprobs": 0},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_bad_values_are_400s(server):
    url, _ = server
    for extra in (
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"max_tokens": -1},
        {"max_tokens": 0, "min_tokens": 1},
        {"repetition_penalty": "NaN"},
        {"temperature": float("inf")},
    ):
        body = {"model": MODEL_NAME, "prompt": "x", **extra}
        r = httpx.post(
            url + "/v1/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
