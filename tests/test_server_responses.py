"""``/v1/responses`` through the openai SDK: text and message input, instructions, limits,
``text.format`` JSON schemas, streaming with the documented events, and what is refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server.engine_holder import EngineHolder

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(path):
    llm = tiny_llm(path, max_num_seqs=4)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat_text(client, messages, max_tokens) -> str:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return out.choices[0].message.content


def test_text_and_messages_answer_as_chat_does(client):
    r = client.responses.create(
        model=MODEL_NAME,
        input="tell me",
        instructions="be brief",
        max_output_tokens=6,
        temperature=0,
    )
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me"}]
    assert r.object == "response" and r.output_text == _chat_text(client, chat, 6)
    assert 0 < r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "tell me"}]},
    ]
    r2 = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=6, temperature=0)
    assert r2.output_text == r.output_text


def test_json_schema_format_is_enforced(client):
    r = client.responses.create(
        model=MODEL_NAME,
        input="a record",
        max_output_tokens=60,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "rec", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_streamed_events_rebuild_the_response(client):
    kw = dict(model=MODEL_NAME, input="stream this", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"text": {"format": {"type": "grammar"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
    ],
)
def test_unsupported_inputs_are_400s_naming_the_field(client, extra, param):
    kw = {"model": MODEL_NAME, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert e.value.body["param"] == param


# -- function tools --------------------------------------------------------------------------------
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
FN_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("resp-tools") / "model")
    llm = tiny_llm(model, max_num_seqs=4, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_function_tools_call_and_take_results(tool_client):
    kw = dict(
        model=MODEL_NAME,
        tools=FN_TOOLS,
        tool_choice="required",
        max_output_tokens=200,
        parallel_tool_calls=False,
    )
    r = tool_client.responses.create(**kw, input="weather in Oslo?")
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = [
        "weather in Oslo?",
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"},
    ]
    history[0] = {"role": "user", "content": history[0]}
    follow = tool_client.responses.create(
        model=MODEL_NAME, input=history, tools=FN_TOOLS, tool_choice="none", max_output_tokens=5
    )
    assert follow.output[0].type == "message" and follow.output_text
    named = tool_client.responses.create(
        **{**kw, "tool_choice": {"type": "function", "name": "get_weather"}}, input="now"
    )
    assert [i.type for i in named.output] == ["function_call"]


def test_streamed_function_calls(tool_client):
    kw = dict(
        model=MODEL_NAME,
        tools=FN_TOOLS,
        tool_choice="required",
        max_output_tokens=200,
        parallel_tool_calls=False,
        input="weather?",
        temperature=1.0,
    )
    events = list(tool_client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds, "calls only: no message item"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    final = events[-1].response
    assert [i.type for i in final.output] == ["function_call"]
    assert final.output[0].arguments == done.arguments
