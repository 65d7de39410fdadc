"""Edge cases of the OpenAI-compatible server, checked against what the OpenAI API (and its
official client) specify: streaming with n > 1 and several prompts, stop strings across token
boundaries, logprobs while streaming, echo, structured outputs while streaming, multi-byte
text, malformed requests, and a client that hangs up next to an identical request.

The review found five bugs (repeated finish chunks with n > 1, 500s for out-of-range extension
values, streamed text offsets, echo with logprobs, chat logprob bytes); they are fixed and
these tests hold them fixed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import stop_window
from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

NO_EOS = {"ignore_eos": True}
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(path):
    llm = tiny_llm(path, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    with running_server(EngineHolder.ready(llm.engine), enable_debug=True) as url:
        yield url, llm


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=60)


def _sse_chunks(url: str, route: str, body: dict) -> list[dict]:
    """Every ``data:`` payload of a streamed response, up to ``[DONE]`` (which must come)."""
    chunks = []
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
    raise AssertionError("the stream ended without [DONE]")


def _wait_drained(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/debug/engine", timeout=30).json()
        if not state["unfinished"] and state["kv_blocks_used"] == 0:
            return state
        assert time.monotonic() < deadline, f"requests stuck: {state}"
        time.sleep(0.05)


def _per_index(chunks: list[dict], field) -> tuple[dict, dict]:
    """(index -> concatenated text, index -> list of finish_reasons seen) of stream chunks."""
    texts, finishes = defaultdict(str), defaultdict(list)
    for chunk in chunks:
        for ch in chunk["choices"]:
            texts[ch["index"]] += field(ch) or ""
            if ch["finish_reason"] is not None:
                finishes[ch["index"]].append(ch["finish_reason"])
    return dict(texts), dict(finishes)


def _split_stop(texts: list[str]) -> str:
    """A 2-char stop string early in ``texts[0]`` that ``texts[1]`` never contains, so that
    choice 0 stops early while choice 1 runs to max_tokens."""
    for start in range(1, len(texts[0]) // 2):
        _, s = stop_window(texts[0], start, 2)
        if s not in texts[1] and texts[0].index(s) < len(texts[0]) // 2:
            return s
    raise AssertionError(f"precondition: no usable stop string in {texts!r}")


# -- n > 1 while streaming ---------------------------------------------------------------------
COMPLETION_N2 = {
    "model": MODEL_NAME,
    "prompt": "the quick brown fox",
    "max_tokens": 24,
    "temperature": 1.0,
    "n": 2,
    "seed": 11,
    **NO_EOS,
}
CHAT_N2 = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 24,
    "temperature": 1.0,
    "n": 2,
    "seed": 5,
    **NO_EOS,
}


def _choice_texts(url: str, route: str, body: dict) -> list[str]:
    out = _post(url, route, body).json()
    by_index = {c["index"]: c for c in out["choices"]}
    return [c.get("text", c.get("message", {}).get("content")) for _, c in sorted(by_index.items())]


def test_completion_stream_n2_concatenation_matches_non_streamed(url):
    whole = _post(url, "/v1/completions", COMPLETION_N2).json()
    chunks = _sse_chunks(url, "/v1/completions", COMPLETION_N2)
    texts, finishes = _per_index(chunks, lambda ch: ch["text"])
    assert sorted(texts) == [0, 1]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0] != texts[1]
    assert {i: f[-1] for i, f in finishes.items()} == {0: "length", 1: "length"}


def test_chat_stream_n2_concatenation_matches_non_streamed(url):
    whole = _post(url, "/v1/chat/completions", CHAT_N2).json()
    chunks = _sse_chunks(url, "/v1/chat/completions", CHAT_N2)
    roles = [ch["index"] for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
    assert sorted(roles) == [0, 1], "one role delta per choice"
    texts, finishes = _per_index(chunks, lambda ch: ch["delta"].get("content"))
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert {i: f[-1] for i, f in finishes.items()} == {0: "length", 1: "length"}


@pytest.mark.parametrize(
    "case", ["completions", "chat", "completions-stop", "chat-stop", "two-prompts"]
)
def test_stream_n2_each_choice_finishes_exactly_once(url, case):
    route = "/v1/chat/completions" if case.startswith("chat") else "/v1/completions"
    body = CHAT_N2 if case.startswith("chat") else COMPLETION_N2
    if route == "/v1/completions":
        field = lambda ch: ch["text"]  # noqa: E731
    else:
        field = lambda ch: ch["delta"].get("content")  # noqa: E731
    expected = {0: ["length"], 1: ["length"]}
    if case.endswith("-stop"):
        body = {**body, "stop": [_split_stop(_choice_texts(url, route, body))]}
        expected = {0: ["stop"], 1: ["length"]}
    if case == "two-prompts":
        body = {**body, "prompt": ["alpha beta", "gamma delta epsilon"], "max_tokens": 6}
        expected = {i: ["length"] for i in range(4)}
    whole = _choice_texts(url, route, body)
    texts, finishes = _per_index(_sse_chunks(url, route, body), field)
    assert [texts[i] for i in sorted(texts)] == whole
    assert finishes == expected


# -- several prompts ---------------------------------------------------------------------------
def test_two_prompts_n2_are_prompt_major_streamed_and_not(url):
    prompts = ["alpha beta", "gamma delta epsilon"]
    body = {**COMPLETION_N2, "prompt": prompts, "max_tokens": 6}
    whole = _post(url, "/v1/completions", body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    singles = [_post(url, "/v1/completions", {**body, "prompt": p}).json() for p in prompts]
    expected = [c["text"] for s in singles for c in sorted(s["choices"], key=lambda c: c["index"])]
    assert [c["text"] for c in whole["choices"]] == expected, "index = prompt * n + choice"
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert whole["usage"][key] == sum(s["usage"][key] for s in singles)
    chunks = _sse_chunks(
        url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    texts, finishes = _per_index(chunks, lambda ch: ch["text"])
    assert texts == dict(enumerate(expected))
    assert {i: f[-1] for i, f in finishes.items()} == {i: "length" for i in range(4)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


# -- stop strings ------------------------------------------------------------------------------
def test_streamed_stop_string_across_tokens_never_leaks(url):
    body = {"model": MODEL_NAME, "prompt": "one two three", "max_tokens": 40, "temperature": 0}
    full = _post(url, "/v1/completions", {**body, **NO_EOS}).json()["choices"][0]["text"]
    # a 4-char stop string that no single output token contains: it spans a token boundary
    ids = _post(url, "/v1/completions", {**body, **NO_EOS, "logprobs": 0}).json()
    pieces = ids["choices"][0]["logprobs"]["tokens"]
    stop = None
    for start in range(4, len(full) - 8):
        _, s = stop_window(full, start, 4)
        if not any(s in p for p in pieces):
            stop = s
            break
    assert stop is not None, f"precondition: no cross-token stop string in {full!r}"
    cut = full[: full.index(stop)]
    req = {**body, **NO_EOS, "stop": [stop, "\x00never"]}
    out = _post(url, "/v1/completions", req).json()
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    chunks = _sse_chunks(url, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    streamed = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert streamed == cut, "no text at or after the stop string may leak into any chunk"
    assert all(stop not in ch["text"] for c in chunks for ch in c["choices"])
    assert chunks[-1]["usage"] == out["usage"]
    assert out["usage"]["completion_tokens"] < 40


# -- logprobs while streaming ------------------------------------------------------------------
def test_completion_logprobs_streamed_equal_non_streamed(url):
    body = {
        "model": MODEL_NAME,
        "prompt": "dog",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
        **NO_EOS,
    }
    whole = _post(url, "/v1/completions", body).json()
    lp = whole["choices"][0]["logprobs"]
    chunks = _sse_chunks(url, "/v1/completions", body)
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
    values = [v for c in chunks for ch in c["choices"] for v in ch["logprobs"]["token_logprobs"]]
    tops = [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["top_logprobs"]]
    assert len(tokens) == whole["usage"]["completion_tokens"] == 12
    assert tokens == lp["tokens"] and values == pytest.approx(lp["token_logprobs"])
    assert all(len(t) <= 2 for t in tops)
    assert "".join(tokens) == whole["choices"][0]["text"]


def test_completion_logprobs_text_offset_streamed_with_stop(url):
    body = {"model": MODEL_NAME, "prompt": "dog", "max_tokens": 24, "temperature": 0, **NO_EOS}
    full = _post(url, "/v1/completions", body).json()["choices"][0]["text"]
    _, stop = stop_window(full, len(full) * 2 // 3, 5)
    body = {**body, "logprobs": 1, "stop": [stop]}
    whole = _post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks = _sse_chunks(url, "/v1/completions", body)
    offsets = [o for c in chunks for ch in c["choices"] for o in ch["logprobs"]["text_offset"]]
    assert len(offsets) == len(whole["text_offset"])
    assert offsets == whole["text_offset"]


def test_chat_logprobs_streamed_count_equals_completion_tokens(url):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "dog"}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
        **NO_EOS,
    }
    chunks = _sse_chunks(url, "/v1/chat/completions", body)
    entries = [
        e
        for c in chunks
        for ch in c["choices"]
        if ch["logprobs"]
        for e in ch["logprobs"]["content"]
    ]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    whole = _post(url, "/v1/chat/completions", {**body, "stream_options": None})
    content = whole.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in content]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]


# -- echo, max tokens --------------------------------------------------------------------------
def test_echo_streamed_and_not(url):
    body = {"model": MODEL_NAME, "prompt": "héllo wörld", "max_tokens": 8, "temperature": 0}
    plain = _post(url, "/v1/completions", {**body, **NO_EOS}).json()["choices"][0]["text"]
    whole = _post(url, "/v1/completions", {**body, **NO_EOS, "echo": True}).json()
    assert whole["choices"][0]["text"] == body["prompt"] + plain
    chunks = _sse_chunks(url, "/v1/completions", {**body, **NO_EOS, "echo": True, "n": 2})
    texts, _ = _per_index(chunks, lambda ch: ch["text"])
    assert texts == {0: body["prompt"] + plain, 1: body["prompt"] + plain}


def test_echo_with_logprobs_covers_prompt_and_output_streamed_or_not(url):
    """The logprobs columns hold the echoed prompt's tokens (the first unscored) and then the
    output's; a stream sends the same columns over its chunks (values: test_server_prompt_
    logprobs)."""
    body = {
        "model": MODEL_NAME,
        "prompt": "hello world",
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        **NO_EOS,
    }
    whole = _post(url, "/v1/completions", body).json()["choices"][0]
    lp = whole["logprobs"]
    assert whole["text"].startswith("hello world")
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert "".join(lp["tokens"]) == whole["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chunks = _sse_chunks(url, "/v1/completions", {**body, "n": 2})
    for i in (0, 1):
        columns = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch["index"] == i]
        assert [t for col in columns for t in col["tokens"]] == lp["tokens"]
        offsets = [o for col in columns for o in col["text_offset"]]
        assert offsets == lp["text_offset"]


def test_chat_without_max_tokens_runs_to_the_context_limit(url):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], **NO_EOS}
    out = _post(url, "/v1/chat/completions", {**body, "temperature": 0}).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_max_completion_tokens_takes_precedence(client):
    msgs = [{"role": "user", "content": "x"}]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=msgs,
        max_tokens=3,
        max_completion_tokens=7,
        temperature=0,
        extra_body=NO_EOS,
    )
    assert out.usage.completion_tokens == 7
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert out.usage.completion_tokens == 3


# -- structured output and seeds ---------------------------------------------------------------
def test_json_schema_streamed_parses_and_matches_non_streamed(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    args = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=60,
        temperature=0.8,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    whole = client.chat.completions.create(**args).choices[0]
    stream = client.chat.completions.create(**args, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seeded_sampling_same_streamed_and_not(client):
    args = dict(model=MODEL_NAME, prompt="seeded", max_tokens=16, temperature=1.2, top_p=0.9)
    whole = client.completions.create(**args, seed=99, extra_body=NO_EOS).choices[0].text
    stream = client.completions.create(**args, seed=99, stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole
    other = client.completions.create(**args, seed=100, extra_body=NO_EOS).choices[0].text
    assert other != whole


# -- multi-byte text ---------------------------------------------------------------------------
EMOJI = "é😀🎉ü"
EMOJI_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "e", "schema": {"type": "string", "enum": [EMOJI]}},
}


def test_multibyte_output_streams_without_replacement_chars(url, server):
    _, llm = server
    tok = llm.engine.tokenizer
    assert len(tok.encode(EMOJI, add_special_tokens=False)) > len(EMOJI), "split across tokens"
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "emoji 😀 please"}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": EMOJI_FORMAT,
    }
    whole = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert json.loads(whole) == EMOJI
    chunks = _sse_chunks(url, "/v1/chat/completions", body)
    pieces = [ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]]
    assert "".join(pieces) == whole
    assert not any("\ufffd" in p for p in pieces)


def test_chat_logprobs_bytes_rebuild_multibyte_text(url):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "emoji"}],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "response_format": EMOJI_FORMAT,
    }
    choice = _post(url, "/v1/chat/completions", body).json()["choices"][0]
    raw = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert raw.decode("utf-8", errors="replace").startswith(choice["message"]["content"])


# -- malformed requests ------------------------------------------------------------------------
def _error(resp: httpx.Response) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("route", "body", "words"),
    [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 12}]}, ""),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "bot", "content": "x"}]}, ""),
        ("/v1/chat/completions", {**CHAT, "messages": "hello"}, ""),
        ("/v1/completions", {**GOOD, "n": "two"}, "n"),
        ("/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(17)]}, "16"),
        ("/v1/completions", {**GOOD, "stop": [1, 2]}, "stop"),
        ("/v1/completions", {**GOOD, "prompt": "x " * 400}, "max_model_len is 256"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x " * 400}]},
            "max_model_len",
        ),
        ("/v1/completions", {**GOOD, "prompt": [[]]}, "empty"),
        ("/v1/completions", {**GOOD, "prompt": [[], []]}, "empty"),
        ("/v1/completions", {**GOOD, "prompt": [[1, 2], "x"]}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [-1]}, "token ids"),
        ("/v1/completions", {**GOOD, "stop_token_ids": [99999]}, "vocabulary"),
        ("/v1/completions", {**GOOD, "top_k": 1.5}, "top_k"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {**GOOD, "response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_malformed_requests_are_4xx_in_openai_shape(url, route, body, words):
    err = _error(_post(url, route, body))
    assert words in err["message"] or words == err["param"], err


def test_negative_seed_is_accepted_and_reproducible(url):
    a = _post(url, "/v1/completions", {**GOOD, "temperature": 1, "seed": -7}).json()
    b = _post(url, "/v1/completions", {**GOOD, "temperature": 1, "seed": -7}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


@pytest.mark.parametrize(
    "body",
    [
        b"[1, 2, 3]",
        b'"just a string"',
        b"null",
        json.dumps(GOOD).encode()[:-1],
        b"\xff\xfe not utf-8",
    ],
)
def test_non_object_bodies_are_400(url, body):
    resp = httpx.post(
        url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    _error(resp)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_the_content_type(url, ctype):
    """``curl -d '{...}'`` sends a form type; the body is JSON all the same. A real form body
    is a 400 saying it is not JSON."""
    headers = {"content-type": ctype}
    resp = httpx.post(url + "/v1/completions", content=json.dumps(GOOD).encode(), headers=headers)
    assert resp.status_code == 200, resp.text
    resp = httpx.post(url + "/v1/completions", content=b"model=tiny&prompt=hi", headers=headers)
    assert "not valid JSON" in _error(resp)["message"]


def test_a_body_without_content_type_is_read_as_json(url):
    """As vLLM and OpenAI do (``curl -d`` sends none)."""
    resp = httpx.post(url + "/v1/completions", content=json.dumps(GOOD).encode())
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "patch",
    [
        {"top_k": -5},
        {"min_p": 2.0},
        {"repetition_penalty": 0},
        {"min_tokens": -1},
        {"min_tokens": 10, "max_tokens": 3},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_extension_sampling_values_are_400(url, patch):
    for route, base in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        err = _error(_post(url, route, {**base, **patch}))
        assert next(iter(patch)) in err["message"]


def test_server_still_serves_after_malformed_requests(url):
    out = _post(url, "/v1/completions", GOOD)
    assert out.status_code == 200 and out.json()["choices"][0]["text"]


# -- a client that hangs up next to an identical request -----------------------------------------
def test_abort_after_first_chunk_does_not_disturb_a_twin(url):
    body = {
        "model": MODEL_NAME,
        "prompt": "twins share a prefix " * 3,
        "max_tokens": 48,
        "temperature": 0.9,
        "seed": 21,
        "stream": True,
        **NO_EOS,
    }
    solo = "".join(
        ch["text"] for c in _sse_chunks(url, "/v1/completions", body) for ch in c["choices"]
    )

    async def leaver(client: httpx.AsyncClient, started: asyncio.Event) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    return  # hang up right after the first chunk

    async def stayer(client: httpx.AsyncClient) -> str:
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
        return text

    async def main() -> str:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            started = asyncio.Event()
            stay = asyncio.ensure_future(stayer(client))
            await leaver(client, started)
            assert started.is_set()
            return await stay

    assert asyncio.run(main()) == solo
    state = _wait_drained(url)
    assert state["invariants_ok"]
