"""Tool calling: each model family's call syntax (``ToolFormat``), the structural tag that
enforces it (xgrammar: free text until the model opens a call, then the call's arguments are
constrained to the function's schema), and the parser that turns generated text into OpenAI
``tool_calls``. Formats: Hermes ``<tool_call>`` JSON (Qwen2/3 and the demo model), Llama 3.1
JSON calls, Mistral's ``[TOOL_CALLS]`` list."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from warmboot.server.fields import UnsupportedParameter

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI sends it (cut short when the call is incomplete)."""
    id: str = ""
    complete: bool = True
    """False: the token limit cut the call; ``arguments`` are what was generated."""

    def openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def detect_format(chat_template: str | None) -> str | None:
    """The call syntax a chat template teaches its model, or None (no tool support)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def functions(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """OpenAI chat tools -> {name: JSON schema of its arguments}; 400 naming the problem."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UnsupportedParameter("tools", f"tools[{i}] is not a function tool with a name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise UnsupportedParameter("tools", f"tools[{i}].function.parameters is not a schema")
        out[fn["name"]] = params
    return out


def chosen(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """(mode, function name): mode is none, auto, required or named."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if name not in names:
            raise UnsupportedParameter("tool_choice", f"tool_choice names {name!r}, not a tool")
        return "named", name
    raise UnsupportedParameter("tool_choice", f"unsupported tool_choice {tool_choice!r}")


# -- enforcement ---------------------------------------------------------------------------------
def structural_tag(
    fmt: str, schemas: dict[str, dict], mode: str, name: str | None, parallel: bool
) -> dict:
    """The xgrammar structural tag for ``mode`` (auto, required, named) in format ``fmt``."""
    if name is not None:
        schemas = {name: schemas[name]}
    tags = [_tag(fmt, n, s) for n, s in schemas.items()]
    if mode == "named":
        return {"type": "structural_tag", "format": tags[0]}
    if mode == "required":  # calls only, one or more (parallel), nothing around them
        fmt_ = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        return {"type": "structural_tag", "format": fmt_}
    triggers = {
        "hermes": ["<tool_call>"],
        "llama3_json": ['{"name": '],
        "mistral": ["[TOOL_CALLS]"],
    }[fmt]
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "stop_after_first": not parallel,
        },
    }


def _tag(fmt: str, name: str, schema: dict) -> dict:
    # NOTE: at most one whitespace character in a row (xgrammar allows no less): small
    # models otherwise loop on whitespace and never close the call
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    quoted = json.dumps(name)
    begin, end = {
        "hermes": (f'<tool_call>\n{{"name": {quoted}, "arguments": ', "}\n</tool_call>"),
        "llama3_json": (f'{{"name": {quoted}, "parameters": ', "}"),
        "mistral": (f'[TOOL_CALLS][{{"name": {quoted}, "arguments": ', "}]"),
    }[fmt]
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def trigger(fmt: str) -> str:
    """The text that opens a call: streamed text is held back from here."""
    return {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]"}[fmt]


# -- parsing ---------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse(fmt: str, text: str, names: set[str], cut: bool = False) -> tuple[str, list[ToolCall]]:
    """(content, calls) of generated ``text``: the content is the text less the calls (not
    stripped: a stream has sent its start); calls to unknown functions or with arguments that
    are not a JSON object stay in the content. ``cut``: the token limit ended the text, so a
    call left open at its end is returned incomplete, never as content."""
    content, calls = _parse_whole(fmt, text, names)
    if not cut:
        return content, calls
    content, last = _open_call(fmt, content, names)
    return content, calls + ([last] if last else [])


def _parse_whole(fmt: str, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    spans: list[tuple[int, int, dict]] = []
    if fmt == "hermes":
        for m in _HERMES.finditer(text):
            obj = _json(m.group(1))
            if obj is not None:
                spans.append((m.start(), m.end(), obj))
    else:
        opener, pos = trigger(fmt), 0
        while (start := text.find(opener, pos)) >= 0:
            begin = start + len(opener) if fmt == "mistral" else start
            found = _raw_json(text, begin)
            if found is None:
                pos = start + 1
                continue
            objs, pos = found
            spans += [(start, pos, obj) for obj in (objs if isinstance(objs, list) else [objs])]
    return _calls(fmt, text, spans, names)


def _calls(fmt: str, text: str, spans, names: set[str]) -> tuple[str, list[ToolCall]]:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    calls, cut, kept = [], [], set()
    for start, end, obj in spans:
        name, args = obj.get("name"), obj.get(key, obj.get("arguments"))
        if name not in names or not isinstance(args, dict):
            continue
        calls.append(ToolCall(name, json.dumps(args), _call_id()))
        if (start, end) not in kept:
            kept.add((start, end))
            cut.append((start, end))
    content, last = [], 0
    for start, end in sorted(cut):
        content.append(text[last:start])
        last = end
    content.append(text[last:])
    joined = "".join(content)
    if fmt == "llama3_json" and calls:  # the calls' separators and python tag
        joined = joined.replace("<|python_tag|>", "").strip(" ;\n")
    return joined, calls


# NOTE: strict=False admits raw control characters in strings: xgrammar 0.2.8 lets them into
# length-bounded strings (see grammar_backend); the arguments go out re-serialized, escaped.
_DECODER = json.JSONDecoder(strict=False)


def _json(text: str) -> dict | None:
    try:
        obj = _DECODER.decode(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _raw_json(text: str, start: int) -> tuple[Any, int] | None:
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    ok = isinstance(obj, dict) or (isinstance(obj, list) and all(isinstance(o, dict) for o in obj))
    return (obj, end) if ok else None


_OPEN_CALL = {
    "hermes": re.compile(r'\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*(.*)', re.S),
    "llama3_json": re.compile(r'\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"parameters"\s*:\s*(.*)', re.S),
    "mistral": re.compile(r'\[?\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*(.*)', re.S),
}
"""A call's start up to its arguments (the structural tag writes it so), from the opener."""


def _open_call(fmt: str, content: str, names: set[str]) -> tuple[str, ToolCall | None]:
    """(content, call): the markup from a call opened and not closed at the end of
    ``content`` (or a tail that could begin one) taken off; the call, with its arguments so
    far, when its name is complete and known."""
    opener = trigger(fmt)
    start = held_back(content, opener)
    if start == len(content):
        return content, None
    tail = content[start + len(opener) :] if fmt != "llama3_json" else content[start:]
    found = _OPEN_CALL[fmt].match(tail.lstrip()) if content.startswith(opener, start) else None
    if found is None or found.group(1) not in names:
        return content[:start], None
    args, whole = found.group(2).rstrip(), _raw_json(found.group(2), 0)
    if whole is not None and isinstance(whole[0], dict):  # only the closing markup was cut
        return content[:start], ToolCall(found.group(1), json.dumps(whole[0]), _call_id())
    return content[:start], ToolCall(found.group(1), args, _call_id(), complete=False)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, opener: str) -> int:
    """How much of ``text`` may stream as content now: up to the opener, or up to a tail that
    could still become it."""
    i = text.find(opener)
    if i >= 0:
        return i
    for k in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-k:]):
            return len(text) - k
    return len(text)


# -- one request's tools -----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: how calls look, which names exist, the tag enforcing them."""

    fmt: str
    names: frozenset[str]
    tag: dict

    def message(self, text: str, cut: bool = False) -> tuple[dict, bool]:
        """The assistant message for generated ``text`` and whether it holds calls; ``cut``:
        the token limit ended it (see ``parse``)."""
        content, calls = parse(self.fmt, text, set(self.names), cut)
        if not calls:
            return {"role": "assistant", "content": content}, False
        message = {"role": "assistant", "content": content.strip() or None}
        message["tool_calls"] = [call.openai() for call in calls]
        return message, True


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool, fmt: str | None):
    """The plan for a request, or None when it offers no tools or ``tool_choice`` is none."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise UnsupportedParameter("tool_choice", "tool_choice needs tools")
        return None
    schemas = functions(tools)
    mode, name = chosen(tool_choice, list(schemas))
    if mode == "none":
        return None
    if fmt is None:
        raise UnsupportedParameter(
            "tools",
            "this model's chat template shows no tool-call format; start the server "
            "with --tool-call-parser " + "|".join(FORMATS),
        )
    tag = structural_tag(fmt, schemas, mode, name, parallel)
    return ToolPlan(fmt, frozenset(schemas), tag)


class ToolStream:
    """One streamed choice: content goes out as it comes, held back from where a call may
    begin; the calls go out at the end, each whole, in OpenAI's delta shape."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan, self.text, self.sent = tool_plan, "", 0
        self._opener = trigger(tool_plan.fmt)

    def feed(self, delta: str) -> str:
        """The content that may go out now."""
        self.text += delta
        safe = held_back(self.text, self._opener)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """(the content not yet sent, the calls as delta entries) once the choice ended;
        ``cut``: the token limit ended it."""
        content, calls = parse(self.plan.fmt, self.text, set(self.plan.names), cut)
        if not calls and not cut:
            content = self.text
        rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
        return rest, [call.openai(index=i) for i, call in enumerate(calls)]
