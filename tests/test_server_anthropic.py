"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
anthropic SDK, on the demo tokenizer's Hermes-style template: plain and system-prompted
messages that answer as chat completions do, stop sequences, the streamed events, a tool round
trip, calls cut by ``max_tokens``, token counts, errors in Anthropic's shape, and the key sent
as ``x-api-key``."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from tests.test_server_tools import ASK, TIME, WEATHER
from warmboot.server.engine_holder import EngineHolder

KEY = "s3cret"
GREEDY = {"extra_body": {"temperature": 0}}  # NOTE: this SDK's create() has no temperature
TOOLS = [
    {"name": "get_weather", "description": "the forecast", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]


@pytest.fixture(scope="module")
def url(path):
    """The tiny Llama: greedy text that is not all blank."""
    llm = tiny_llm(path, max_num_seqs=4)
    with running_server(EngineHolder.ready(llm.engine), api_key=KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    """The small Llama: room in its context for the tools."""
    model = small_llama(tmp_path_factory.mktemp("anthropic") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine)) as base:
        yield anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_answers_as_chat_does(client, url):
    m = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL_NAME and m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 8 and m.stop_sequence is None
    chat = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    same = chat.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0)
    assert _text(m) == same.choices[0].message.content
    assert m.usage.input_tokens == same.usage.prompt_tokens


def test_a_system_prompt_as_text_or_blocks(client):
    kw = dict(model=MODEL_NAME, max_tokens=6, messages=ASK, **GREEDY)
    plain = client.messages.create(system="answer briefly", **kw)
    blocks = [{"type": "text", "text": "answer briefly", "cache_control": {"type": "ephemeral"}}]
    as_blocks = client.messages.create(system=blocks, **kw)
    bare = client.messages.create(**kw)
    assert _text(plain) == _text(as_blocks)
    assert plain.usage.input_tokens == as_blocks.usage.input_tokens > bare.usage.input_tokens


def test_stop_sequences(client):
    kw = dict(model=MODEL_NAME, max_tokens=16, messages=ASK, **GREEDY)
    full = _text(client.messages.create(**kw))
    stop = full[len(full) // 2 :][:2]
    before = full[: full.find(stop)]
    m = client.messages.create(stop_sequences=[stop, "never seen"], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert _text(m) == (before if before.strip() else "")


def test_streamed_events_rebuild_the_message(client):
    kw = dict(model=MODEL_NAME, max_tokens=12, messages=ASK, **GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == _text(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kw) as stream:  # the SDK's own accumulation
        assert _text(stream.get_final_message()) == _text(whole)


def test_a_tool_round_trip(tool_client):
    kw = dict(model=MODEL_NAME, tools=TOOLS, max_tokens=200, extra_body={"temperature": 1.0})
    m = tool_client.messages.create(
        messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw
    )
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER if call.name == "get_weather" else TIME)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "rain, 12 degrees"}
    turn = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [result]},
    ]
    follow = tool_client.messages.create(messages=turn, tool_choice={"type": "none"}, **kw)
    assert follow.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in follow.content)
    none = {"type": "none"}
    count = tool_client.messages.count_tokens(
        model=MODEL_NAME, messages=turn, tools=TOOLS, tool_choice=none
    )
    assert count.input_tokens == follow.usage.input_tokens
    as_blocks = {**result, "content": [{"type": "text", "text": "rain"}]}
    counts = [
        tool_client.messages.count_tokens(
            model=MODEL_NAME, messages=[*turn[:-1], {"role": "user", "content": [block]}]
        ).input_tokens
        for block in (as_blocks, {**as_blocks, "is_error": True})
    ]
    assert counts[0] < counts[1]  # the error is told to the model


def test_a_named_tool_streamed(tool_client):
    named = {"type": "tool", "name": "get_time"}
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=100)
    events = list(tool_client.messages.create(**kw, stream=True))
    (start,) = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_time"
    assert events[-2].delta.stop_reason == "tool_use"
    with tool_client.messages.stream(**kw) as stream:
        (call,) = stream.get_final_message().content
    assert call.type == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, TIME)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens(tool_client, stream):
    """Cut inside its input: dropped; cut in its closing markup only: kept whole."""
    choice = {"type": "any", "disable_parallel_tool_use": True}
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)

    def create(max_tokens: int):
        if not stream:
            return tool_client.messages.create(max_tokens=max_tokens, **kw)
        with tool_client.messages.stream(max_tokens=max_tokens, **kw) as s:
            return s.get_final_message()

    m = create(6)
    assert m.stop_reason == "max_tokens" and m.content == [] and m.usage.output_tokens == 6
    whole = create(200)
    assert whole.stop_reason == "tool_use"
    closed = create(whole.usage.output_tokens - 2)  # NOTE: the end of </tool_call> and EOS
    assert closed.stop_reason == "max_tokens"
    (block,) = closed.content
    assert (block.name, block.input) == (whole.content[0].name, whole.content[0].input)


def test_count_tokens_is_the_messages_input(tool_client):
    kw = dict(model=MODEL_NAME, messages=ASK, system="be brief", tools=TOOLS)
    m = tool_client.messages.create(max_tokens=1, **kw)
    assert tool_client.messages.count_tokens(**kw).input_tokens == m.usage.input_tokens
    plain = tool_client.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens
    assert plain < m.usage.input_tokens  # the tools are in the prompt


def test_a_prefill_is_continued(client, url):
    prefill = [*ASK, {"role": "assistant", "content": "It is"}]
    m = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=prefill, **GREEDY)
    render = {
        "model": MODEL_NAME,
        "messages": prefill,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    auth = {"x-api-key": KEY}
    tokens = httpx.post(url + "/tokenize", json=render, headers=auth).json()["tokens"]
    assert m.usage.input_tokens == len(tokens)
    go = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 4, "temperature": 0}
    same = httpx.post(url + "/v1/completions", json=go, headers=auth).json()
    assert _text(m) == same["choices"][0]["text"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"bogus": 1}, "bogus"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom"),
        ({"model": "other"}, "does not exist"),
    ],
)
def test_refusals_are_anthropic_errors(client, extra, words):
    kinds = {"does not exist": anthropic.NotFoundError}
    with pytest.raises(kinds.get(words, anthropic.BadRequestError)) as e:
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=ASK, extra_body=extra)
    body = e.value.body
    assert body["type"] == "error" and words in body["error"]["message"]
    kind = "not_found_error" if "exist" in words else "invalid_request_error"
    assert body["error"]["type"] == kind


def test_the_key_as_x_api_key(url):
    headers = {"x-api-key": KEY}
    via_header = anthropic.Anthropic(base_url=url, default_headers=headers, max_retries=0)
    m = via_header.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK)
    assert m.usage.output_tokens > 0
    assert httpx.get(url + "/v1/models", headers=headers).status_code == 200  # OpenAI's too
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(url + "/v1/messages", json={"model": MODEL_NAME})
    assert missing.status_code == 401 and missing.json()["type"] == "error"
    bad = httpx.post(
        url + "/v1/messages", headers=headers, json={"model": MODEL_NAME, "messages": ASK}
    )
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    unknown = httpx.post(url + "/v1/messages/batches", headers=headers, json={})
    assert unknown.json()["error"]["type"] == "not_found_error"
    openai_shape = httpx.post(url + "/v1/chat/completions", json={"model": MODEL_NAME})
    assert openai_shape.status_code == 401 and "type" not in openai_shape.json()
