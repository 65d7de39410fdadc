"""The size limits a grammar spec must meet before it is compiled: ``prepare`` checks a
``StructuredOutputs`` against ``GrammarLimits`` and keys it (a ``GrammarKey``), or raises
``GrammarTooLarge`` naming the limit. Compile time grows with a spec's size (see
``grammar_compiles``), so an oversized spec is refused up front, before it takes a compile
thread; the checks walk the parsed document without recursion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmboot.core.errors import InvalidRequestError
from warmboot.device.grammar_backend import spec_key
from warmboot.sampling_params import StructuredOutputs

GrammarKey = tuple[str, str]
"""A spec checked and keyed by ``prepare``: ``(kind, canonical text)``."""


@dataclass(frozen=True)
class GrammarLimits:
    """What a spec may hold. OpenAI's structured outputs allow 5000 object properties, 10
    levels of nesting, 1000 enum values (120k characters of names and values); these admit
    all of that with room to spare, yet refuse the shapes that compile for minutes."""

    max_chars: int = 1 << 20
    """Characters of the schema (as compact JSON), regex, grammar or structural tag."""
    max_depth: int = 128
    """JSON nesting of a schema or structural tag; an object level takes two (the object and
    its ``properties``), so 10 levels of OpenAI's take 20 to 40."""
    max_properties: int = 5000
    """Object properties, all objects together."""
    max_enum_values: int = 10_000
    """``enum`` members and ``const`` values, all together."""
    max_optional_properties: int = 256
    """Properties one object does not list as ``required``: an object's grammar grows with
    the orders its optional properties may come in (1000 compile in 11.5 s and 444 MB, 5000
    take over 10 minutes and 4 GB; all required, 1000 compile in 0.2 s). OpenAI's strict
    structured outputs require every property."""


class GrammarTooLarge(InvalidRequestError):
    """A spec over a ``GrammarLimits`` limit (refused before any compile)."""


def prepare(spec: StructuredOutputs, limits: GrammarLimits) -> GrammarKey:
    """Check ``spec`` against ``limits`` and key it; raise ``InvalidRequestError`` naming the
    limit or the problem. Parses JSON, so call it off the event loop."""
    raw = spec.json if spec.json is not None else spec.structural_tag
    for text in (raw, spec.regex, spec.grammar):
        if isinstance(text, str):
            _check_count(spec, "characters", len(text), limits.max_chars)
    try:
        key = spec_key(spec, lambda kind, doc: _check_doc(kind, doc, limits))
    except RecursionError:
        raise _too_large(_kind(spec), "levels of nesting", "over 500", limits.max_depth) from None
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(str(e)) from None
    _check_count(spec, "characters", len(key[1]), limits.max_chars)
    return key


def _check_doc(kind: str, doc: Any, limits: GrammarLimits) -> None:
    """Refuse a parsed JSON schema or structural tag over the limits (no recursion)."""
    depth = properties = values = optional = 0
    stack = [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            props, enum = node.get("properties"), node.get("enum")
            if isinstance(props, dict):
                properties += len(props)
                optional = max(optional, _optional(props, node.get("required")))
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            stack.extend((v, level + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node if isinstance(v, dict | list))
        depth = max(depth, level)
        if depth > limits.max_depth:
            raise _too_large(
                kind, "levels of nesting", f"over {limits.max_depth}", limits.max_depth
            )
    for what, n, limit in (
        ("object properties", properties, limits.max_properties),
        ("enum/const values", values, limits.max_enum_values),
        ("optional properties in one object", optional, limits.max_optional_properties),
    ):
        if n > limit:
            raise _too_large(kind, what, n, limit)


def _optional(props: dict, required: Any) -> int:
    named = (
        set(required)
        if isinstance(required, list) and all(isinstance(r, str) for r in required)
        else set()
    )
    return sum(1 for name in props if name not in named)


def _check_count(spec: StructuredOutputs, what: str, n: int, limit: int) -> None:
    if n > limit:
        raise _too_large(_kind(spec), what, n, limit)


def _too_large(kind: str, what: str, n: Any, limit: int) -> GrammarTooLarge:
    return GrammarTooLarge(
        f"structured_outputs.{kind} is too large to compile: {n} {what} (the limit is {limit})"
    )


def _kind(spec: StructuredOutputs) -> str:
    for kind in ("json", "regex", "grammar", "structural_tag"):
        if getattr(spec, kind) is not None:
            return kind
    return "json_object"
