"""The three tool-call formats: their structural tags compile for a real tokenizer and accept
what the format's parser reads back; the parsers keep what is not a call as content."""

from __future__ import annotations

import json

import pytest

from warmboot.device.grammar_requests import GrammarRequests
from warmboot.sampling_params import StructuredOutputs
from warmboot.server import tools as T
from warmboot.server.fields import UnsupportedParameter
from warmboot.tokenizer import Tokenizer

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "noop": {"type": "object", "properties": {}},
}
CALLS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "noop", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "noop", "arguments": {}}]',
}


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_parsers_read_every_format(fmt):
    content, calls = T.parse(fmt, CALLS[fmt], set(SCHEMAS))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("noop", {}),
    ]
    assert content.strip() == ("Let me look." if fmt == "hermes" else "")
    assert len({c.id for c in calls}) == 2


def test_unknown_functions_and_broken_calls_stay_content():
    text = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call> <tool_call>{oops</tool_call>'
    assert T.parse("hermes", text, set(SCHEMAS)) == (text, [])


@pytest.mark.parametrize("fmt", T.FORMATS)
@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_structural_tags_compile_and_accept_a_call(fmt, mode, tiny_model_dir):
    path = tiny_model_dir("llama")
    grammars = GrammarRequests(path / "tokenizer.json", 512, (0,))
    name = "get_weather" if mode == "named" else None
    tag = T.structural_tag(fmt, SCHEMAS, mode, name, parallel=False)
    compiled = grammars.compile(StructuredOutputs(structural_tag=tag))
    matcher = grammars.backend.matcher(compiled)
    tok = Tokenizer.from_dir(path)
    one = {
        "hermes": (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        ),
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    }[fmt]
    assert all(matcher.accept(t) for t in tok.encode(one, add_special_tokens=False))
    (call,) = T.parse(fmt, one, set(SCHEMAS))[1]
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_plans_and_refusals():
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    assert T.plan(tools, "none", True, "hermes") is None
    assert T.plan(None, None, True, "hermes") is None
    plan = T.plan(tools, {"type": "function", "function": {"name": "noop"}}, True, "hermes")
    assert plan.tag["format"]["type"] == "tag" and "noop" in plan.tag["format"]["begin"]
    with pytest.raises(UnsupportedParameter, match="--tool-call-parser"):
        T.plan(tools, "auto", True, None)
    with pytest.raises(UnsupportedParameter, match="needs tools"):
        T.plan(None, "required", True, "hermes")
    assert T.detect_format("... <tool_call> ...") == "hermes"
    assert T.detect_format("[TOOL_CALLS]") == "mistral"
    assert T.detect_format("<|python_tag|>") == "llama3_json"
    assert T.detect_format("plain") is None
