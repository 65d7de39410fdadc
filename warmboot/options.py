"""Settings declared once. A config dataclass's field declared with ``setting`` carries its
help, choices and flag spellings; the command lines' options (``add_options``), ``LLM``'s
keyword arguments (``signature``, ``build``) and the values a command line gave (``given``)
are derived from those fields. A leaf: no warmboot import, nothing heavy."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

TRI = {"auto": None, "on": True, "off": False, "true": True, "false": False}
"""The spellings of a tri-state setting's value (``bool | None``: None is auto)."""


def setting(default: Any = MISSING, help: str = "", **spelling: Any) -> Any:
    """A dataclass field that is a user-facing setting. ``spelling`` may hold ``name`` (its
    keyword argument when not the field's name), ``flag`` (its option when not
    ``--field-name``), ``aliases`` (other accepted spellings: vLLM's), ``short``, ``negative``
    (spellings of a tri-state's off), ``choices``, ``metavar``, ``group`` (its ``--help``
    section) and ``factory`` (a default factory: a nested config's class)."""
    unknown = set(spelling) - set(_SPELLING)
    if unknown:
        raise TypeError(f"setting() got unknown spellings {sorted(unknown)}")
    factory = spelling.pop("factory", MISSING)
    meta = {"option": _SPELLING | spelling | {"help": help}}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_SPELLING: dict[str, Any] = dict.fromkeys(("name", "flag", "short", "choices", "metavar", "group"))
_SPELLING |= {"aliases": (), "negative": (), "factory": MISSING}


@dataclass(frozen=True)
class Option:
    """One setting as entry points see it: a flat ``name`` (keyword argument, ``argparse``
    dest) and the attribute ``path`` from the root config to the field."""

    name: str
    path: tuple[str, ...]
    kind: type
    """int, float, str or bool (of each value, for ``multiple``)."""
    optional: bool
    """None is a value (``X | None``)."""
    default: Any
    help: str
    flags: tuple[str, ...]
    """The spellings of its option, ours first."""
    choices: tuple | None = None
    negative: tuple[str, ...] = ()
    metavar: str | None = None
    group: str | None = None
    multiple: bool = False
    """A ``tuple[kind, ...]``: the option takes one value or more (``nargs="+"``); the last
    use of the option wins (as vLLM's ``--lora-modules``)."""

    @property
    def tri_state(self) -> bool:
        return self.kind is bool and self.optional


def options(cls: type, group: str | None = None, path: tuple[str, ...] = ()) -> list[Option]:
    """Every setting of the dataclass ``cls``, nested configs' included (a nested config's
    ``setting`` names the ``--help`` group of its fields)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        kind, optional = _kind(hints[f.name])
        if dataclasses.is_dataclass(kind):
            found += options(kind, meta["group"] or group, (*path, f.name))
            continue
        found.append(_option(f, meta, kind, optional, group, (*path, f.name)))
    return found


def _option(f, meta: dict, kind: type, optional: bool, group, path) -> Option:
    name = meta["name"] or f.name
    multiple = typing.get_origin(kind) is tuple
    if multiple:
        args = typing.get_args(kind)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"setting {name}: a tuple setting is tuple[X, ...], not {kind}")
        kind = args[0]
    flags = (meta["flag"] or "--" + name.replace("_", "-"), *meta["aliases"])
    flags = (*flags, meta["short"]) if meta["short"] else flags
    choices = tuple(meta["choices"]) if meta["choices"] else None
    return Option(
        name=name,
        path=path,
        kind=kind,
        optional=optional,
        default=_default(f),
        help=meta["help"],
        flags=flags,
        choices=choices,
        negative=tuple(meta["negative"]),
        metavar=meta["metavar"],
        group=meta["group"] or group,
        multiple=multiple,
    )


def _kind(hint: Any) -> tuple[type, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def add_options(
    parser: argparse.ArgumentParser, opts: Iterable[Option], defaults: Mapping[str, Any] = {}
) -> None:
    """Add ``opts`` to ``parser``, each in its ``--help`` group; ``defaults`` overrides a
    setting's default for this command line."""
    groups: dict[str, Any] = {}
    for opt in opts:
        where = parser
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            where = groups[opt.group]
        _add(where, opt, defaults.get(opt.name, opt.default))


def _add(where, opt: Option, default: Any) -> None:
    shown = _shown(opt, default)
    text = f"{opt.help} (default: {shown})" if shown is not None else opt.help
    common = dict(dest=opt.name, default=default, help=text.replace("%", "%%"))
    if opt.tri_state:
        choices = "{" + ",".join(("auto", "on", "off")) + "}"
        where.add_argument(*opt.flags, nargs="?", const=True, type=_tri, metavar=choices, **common)
        negative = ("--no-" + opt.flags[0][2:], *opt.negative)
        off = f"same as {opt.flags[0]} off"
        where.add_argument(*negative, dest=opt.name, action="store_const", const=False, help=off)
    elif opt.kind is bool:
        where.add_argument(*opt.flags, action=argparse.BooleanOptionalAction, **common)
    elif opt.multiple:
        metavar = opt.metavar or opt.flags[0][2:].upper().replace("-", "_")
        typed = dict(type=opt.kind, choices=opt.choices, metavar=metavar)
        where.add_argument(*opt.flags, nargs="+", action=_StoreTuple, **typed, **common)
    else:
        kind = _nullable(opt.kind) if opt.optional else opt.kind
        metavar = opt.metavar or (
            None if opt.choices else opt.flags[0][2:].upper().replace("-", "_")
        )
        typed = dict(type=kind, choices=opt.choices, metavar=metavar)
        where.add_argument(*opt.flags, **typed, **common)


def _shown(opt: Option, default: Any) -> str | None:
    if opt.tri_state:
        return {None: "auto", True: "on", False: "off"}[default]
    if opt.multiple:
        return " ".join(map(str, default)) or None
    if default is None:
        return None
    return str(default)


class _StoreTuple(argparse.Action):
    """``nargs="+"``'s values as a tuple (a setting's value is hashable plain data)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(values))


def _tri(text: str) -> bool | None:
    if text.lower() not in TRI:
        raise argparse.ArgumentTypeError(f"{text!r}: use auto, on or off")
    return TRI[text.lower()]


def _nullable(kind: type):
    """A value, or ``none`` for None (a setting whose default is not None)."""

    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def given(args: argparse.Namespace, opts: Iterable[Option]) -> dict[str, Any]:
    """The settings of ``opts`` that a command line set to other than their declared
    default (its own defaults, ``add_options``' ``defaults``, included): plain JSON data."""
    return {
        o.name: getattr(args, o.name)
        for o in opts
        if hasattr(args, o.name) and getattr(args, o.name) != o.default
    }


def build(cls: type, values: Mapping[str, Any], opts: list[Option] | None = None):
    """An instance of ``cls`` from flat ``values``: its settings by their ``Option.name``,
    its other fields by field name; a name that is neither is a ``TypeError`` naming it."""
    opts = options(cls) if opts is None else opts
    unknown = set(values) - {o.name for o in opts} - _plain_fields(cls)
    if unknown:
        raise TypeError(f"{cls.__name__} got unexpected settings: {', '.join(sorted(unknown))}")
    nested: dict[tuple[str, ...], dict[str, Any]] = {(): {}}
    for o in opts:
        if o.name in values:
            nested.setdefault(o.path[:-1], {})[o.path[-1]] = values[o.name]
    nested[()] |= {k: v for k, v in values.items() if k in _plain_fields(cls)}
    return _assemble(cls, (), nested)


def _assemble(cls: type, path: tuple[str, ...], nested: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = dict(nested.get(path, {}))
    for f in dataclasses.fields(cls):
        kind, _ = _kind(hints[f.name])
        sub = (*path, f.name)
        if dataclasses.is_dataclass(kind) and any(p[: len(sub)] == sub for p in nested):
            kwargs[f.name] = _assemble(kind, sub, nested)
    return cls(**kwargs)


def _plain_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if "option" not in f.metadata}


def check_choices(config: Any) -> None:
    """Raise ``ValueError`` naming a setting of ``config`` (not its nested configs) whose
    value is not among its declared choices."""
    for o in options(type(config)):
        if len(o.path) > 1 or not o.choices:
            continue
        value = getattr(config, o.path[0])
        if value is not None and value not in o.choices:
            raise ValueError(f"{o.name}={value!r}: use one of {', '.join(map(str, o.choices))}")


def signature(opts: Iterable[Option], before: list, after: list) -> inspect.Signature:
    """A signature of keyword-only settings between ``before`` and ``after`` parameters (for
    ``help()``, editors and ``inspect``)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(o.name, kw, default=o.default) for o in opts]
    return inspect.Signature([*before, *params, *after])


def describe(opts: Iterable[Option]) -> str:
    """A docstring section listing the settings: name, default, help."""
    lines = ["Settings (keyword arguments; ``warmboot serve --help`` lists them as options):"]
    for o in opts:
        lines.append(f"    {o.name} = {o.default!r}: {o.help}")
    return "\n".join(lines)
