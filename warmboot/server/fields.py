"""What every request API shares: the strict base model (an unknown key is a 400 naming it;
fields accepted only at their default, ``_refused``), the fields ignored by design
(``IgnoredByDesign``), chat messages (``ChatMessage``), OpenAI's ``response_format`` and vLLM's ``structured_outputs`` turned into
``StructuredOutputs``, ``UnsupportedParameter`` (a 400 naming the field) and OpenAI's error
shape."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from warmboot.sampling_params import StructuredOutputs


class UnsupportedParameter(ValueError):
    """A request field that warmboot cannot honour; reported as a 400 naming ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    """Nested objects: unknown keys are ignored (clients send back assistant messages with
    response-only keys such as ``refusal``, ``annotations`` or ``reasoning_content``)."""

    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request body or an option object: an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    _refused: dict[str, str] = {}
    """Fields accepted only at their default: name -> why anything else is refused."""

    def check_refused(self) -> None:
        for name, why in self._refused.items():
            value = getattr(self, name)
            if value != type(self).model_fields[name].default and value not in _UNSET:
                raise UnsupportedParameter(name, f"{name} is not supported: {why}")


_UNSET = (None, False, [], {})


class IgnoredByDesign(_Strict):
    """Fields accepted and ignored by design: identification, billing and storage hints (the
    server is state-free: nothing is stored); none changes the output. (Prefix caching is
    automatic.) Chat also ignores ``prediction``, a latency hint."""

    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: usage in every chunk."""
    include_obfuscation: bool | None = None
    """OpenAI's padding against length side channels: ignored by design (loopback or TLS)."""


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object, structural_tag."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_fallback: bool = False
    """Honoured trivially: warmboot has one grammar backend and never falls back."""
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    _refused = {
        "disable_any_whitespace": "xgrammar's JSON grammars here allow JSON whitespace",
        "disable_additional_properties": "give additionalProperties: false in the schema",
        "whitespace_pattern": "xgrammar has no whitespace pattern",
    }

    def spec(self) -> StructuredOutputs:
        self.check_refused()
        given = {k: v for k, v in self._forms().items() if v not in (None, False)}
        if len(given) != 1:
            raise UnsupportedParameter(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag (got {sorted(given) or 'none'})",
            )
        ((kind, value),) = given.items()
        if kind == "choice":
            return StructuredOutputs(grammar=choice_grammar(value, "structured_outputs"))
        return StructuredOutputs(**{kind: value})

    def _forms(self) -> dict[str, Any]:
        return {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
            "structural_tag": self.structural_tag,
        }


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar admitting exactly one of ``choices`` (JSON string literals are valid
    EBNF literals)."""
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise UnsupportedParameter(param, "choice needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class JsonSchema(_Strict):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


def _structured(fmt: ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise UnsupportedParameter(
            "response_format", "response_format json_schema needs json_schema.schema"
        )
    return StructuredOutputs(json=fmt.json_schema.schema_)


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The Hugging Face message shape: tool calls' arguments as objects."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedParameter(
                    "messages", f"content parts of type {part.get('type')!r} are not supported"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise UnsupportedParameter(
                "messages", f"tool call arguments are not JSON: {fn['arguments'][:80]!r}"
            ) from None
    return {"id": call.get("id"), "type": "function", "function": fn}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
