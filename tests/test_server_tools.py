"""Tool calling in ``/v1/chat/completions`` through the openai SDK, on the demo tokenizer's
Hermes-style template: every ``tool_choice``, parallel calls, streamed calls reassembled,
``parse`` with pydantic tools, a tool-result round trip, and the grammar that keeps an
``auto`` call well formed once the model opens it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.server_harness import MODEL_NAME, running_server, small_llama, tiny_llm
from warmboot.server import tools as T
from warmboot.server.engine_holder import EngineHolder

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = small_llama(tmp_path_factory.mktemp("tools") / "model")
    llm = tiny_llm(model, max_num_seqs=8, max_model_len=1024)
    with running_server(EngineHolder.ready(llm.engine)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_validate_against_their_schemas(client, seed):
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        seed=seed,
        temperature=1.0,
    )
    one = client.chat.completions.create(**kw, parallel_tool_calls=False, max_tokens=200)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None, "required: calls only"
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    many = client.chat.completions.create(**kw, max_tokens=300).choices[0]
    if many.finish_reason == "length":  # the random model calls on: the last call is cut
        assert many.message.content is None, "no call markup in the content"
        *whole, last = many.message.tool_calls
        for call in whole:
            _check_calls([call])
        assert last.function.name in SCHEMAS and last.function.arguments.startswith("{")
    else:
        _check_calls(many.message.tool_calls)
        assert many.finish_reason == "tool_calls" and many.message.content is None


def test_a_named_call(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=150
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_calls([call])


def test_none_and_auto(client, server):
    _, llm = server
    none = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0
    )
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools in the prompt
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=60, seed=seed
        )
        calls = out.choices[0].message.tool_calls
        if calls:
            _check_calls(calls)
            assert out.choices[0].finish_reason == "tool_calls"


def test_auto_calls_are_constrained_once_opened(server):
    """The auto grammar accepts free text, then a call whose arguments fit the schema, and
    refuses any token that would break a call the model has opened."""
    _, llm = server
    grammars = llm.engine.grammars
    tag = T.structural_tag("hermes", SCHEMAS, "auto", None, parallel=True)
    tok = llm.engine.tokenizer
    opened = 'some text <tool_call>\n{"name": "get_weather", "arguments": {"city": '

    def accepts(text: str) -> bool:
        from warmboot.sampling_params import StructuredOutputs

        matcher = grammars.backend.matcher(grammars.compile(StructuredOutputs(structural_tag=tag)))
        return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts("free text only, no call")
    assert accepts(opened + '"Paris", "days": 3}}\n</tool_call> and more text')
    assert not accepts(opened + "42")
    assert not accepts('x <tool_call>\n{"name": "rm_rf", "arguments": {}}')


def test_streamed_calls_reassemble_to_the_whole_response(client):
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=3,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_with_a_pydantic_tool(client):
    out = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=200,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather)


def test_a_tool_result_round_trip(client, server):
    _, llm = server
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert second.choices[0].message.content is not None
    tok = llm.engine.tokenizer
    fn = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    called = {"role": "assistant", "content": None, "tool_calls": [{"function": fn}]}
    answered = [*ASK, called, {"role": "tool", "content": "sunny, 21 C"}]
    rendered = tok.apply_chat_template(answered, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert second.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tool_requests_are_400s(client, kw, param):
    args = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("max_tokens", [4, 20, 40])
def test_a_call_cut_by_the_token_limit_is_a_call_not_text(client, max_tokens):
    """Cut anywhere (in the opener, the name or the arguments): no markup in the content;
    once the name is out, an incomplete call with the arguments so far, as OpenAI returns
    one; streamed the same."""
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=0,
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content, "call markup must never land in content"
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.function.name in SCHEMAS
        assert (
            '{"name"' not in call.function.arguments
            and "<tool_call>" not in call.function.arguments
        )
    streamed, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or ():
            streamed[c.index] = (c.function.name, c.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and content == ""
    assert list(streamed.values()) == [(c.function.name, c.function.arguments) for c in calls]
    if max_tokens == 40:  # past the opener and name: the call with its arguments so far
        (call,) = calls
        assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_a_cut_call_in_the_responses_api_is_an_incomplete_function_call(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    kw = dict(
        model=MODEL_NAME,
        input="weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    kinds = [item.type for item in r.output]
    assert kinds == ["function_call"], kinds
    assert r.output[0].status == "incomplete" and r.output[0].name == "get_weather"
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert not any(e.type == "response.output_text.delta" for e in events), "no markup as text"
