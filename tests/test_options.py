"""Settings declared once (``warmboot.options``): every setting reaches every entry point it
belongs to (each command line, ``LLM``'s keyword arguments) with one help text, a value given
on a command line reaches the config it sets, and the README's ``serve`` synopsis matches
``--help``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from warmboot.cli import build_parser, launch_options, server_settings
from warmboot.config import (
    ENGINE_OPTIONS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
)
from warmboot.engine_options import engine_kwargs
from warmboot.fleet.cli import FLEET_OWN, fleet_config
from warmboot.fleet.config import AutoscalingConfig, FleetConfig
from warmboot.launcher.launch_config import LaunchConfig
from warmboot.options import Option, build, options
from warmboot.server.config import AdmissionLimits, HttpLimits, ServerConfig
from warmboot.snapshot.cli import CREATE_OWN

ROOT = Path(__file__).resolve().parent.parent
ENGINE = {o.name: o for o in ENGINE_OPTIONS}
SERVER = options(ServerConfig) + options(HttpLimits)
FLEET = options(FleetConfig)
EXPECTED = {
    # command -> the settings it offers
    ("generate",): list(ENGINE_OPTIONS),
    ("serve",): SERVER + launch_options() + list(ENGINE_OPTIONS),
    ("demo",): [o for o in launch_options() if o.name == "sandbox"] + list(ENGINE_OPTIONS),
    ("snapshot", "create"): [o for o in ENGINE_OPTIONS if o.name not in CREATE_OWN],
    ("fleet",): FLEET + [o for o in ENGINE_OPTIONS if o.name not in FLEET_OWN],
}
NOT_SETTINGS = {
    # fields that are no setting, and why: anything else added without ``setting`` fails
    (EngineConfig, "model"),  # every entry point's own argument
    (AdmissionLimits, "max_num_seqs"),  # the engine's max_num_seqs
    (FleetConfig, "model_id"),  # --served-model-name, or the model directory's name
    (FleetConfig, "model_source"),  # --model
    (FleetConfig, "engine_kwargs"),  # the engine options and --engine-kwargs
}
CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig, LoRAConfig, ServerConfig, AdmissionLimits)
CONFIGS += (HttpLimits, FleetConfig, AutoscalingConfig)


def _subparser(command: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in command:
        parser = next(
            a.choices[word] for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        )
    return parser


def _missing(parser: argparse.ArgumentParser, opts: list[Option]) -> list[str]:
    """The settings ``parser`` lacks, or offers under other spellings or another help."""
    by_dest: dict[str, list] = {}
    for a in parser._actions:
        by_dest.setdefault(a.dest, []).append(a)
    bad = []
    for o in opts:
        actions = by_dest.get(o.name, [])
        if not set(o.flags) <= {s for a in actions for s in a.option_strings}:
            bad.append(f"{o.name}: no option {o.flags[0]}")
        elif not actions[0].help.startswith(o.help.replace("%", "%%")):
            bad.append(f"{o.name}: another help text")
    return bad


@pytest.mark.parametrize("command", list(EXPECTED), ids=" ".join)
def test_every_setting_reaches_each_command_line(command):
    assert _missing(_subparser(command), EXPECTED[command]) == []


def test_the_coverage_check_finds_a_missing_option():
    parser = argparse.ArgumentParser()
    kept = [o for o in ENGINE_OPTIONS if o.name != "block_size"]
    for o in kept:
        parser.add_argument(*o.flags, dest=o.name, help=o.help)
    assert _missing(parser, list(ENGINE_OPTIONS)) == ["block_size: no option --block-size"]


def test_every_config_field_is_a_setting_or_named_as_not_one():
    plain = set()
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            nested = isinstance(f.default_factory, type) and dataclasses.is_dataclass(
                f.default_factory
            )
            if "option" not in f.metadata and not nested:
                plain.add((cls, f.name))
    assert plain == NOT_SETTINGS


def test_llm_takes_every_engine_setting_as_a_keyword():
    from warmboot import LLM

    params = inspect.signature(LLM).parameters
    settings = {n: p.default for n, p in params.items() if n not in ("model", "wait_for_compile")}
    assert settings == {o.name: o.default for o in ENGINE_OPTIONS}
    with pytest.raises(TypeError, match=r"\['max_num_seq'\] \(did you mean 'max_num_seqs'\?\)"):
        LLM("unused", max_num_seq=4)


def _sample(o: Option):
    """A valid value other than the default, and its command-line words."""
    if o.tri_state:
        return True, [o.flags[0], "on"]
    if o.kind is bool:
        return not o.default, [o.flags[0] if not o.default else "--no-" + o.flags[0][2:]]
    if o.multiple:  # NOTE: nargs="+": a tuple of one value or more
        return ("a=b", "c=d"), [o.flags[0], "a=b", "c=d"]
    if o.choices:
        value = next(c for c in reversed(o.choices) if c != o.default)
    elif o.kind is str:
        value = "fp8" if o.name == "quantization" else "sample"
    else:
        value = o.kind(128 if o.default == 64 else 64)
    return value, [o.flags[0], str(value)]


def _args(command: tuple[str, ...], opts: list[Option]) -> tuple[argparse.Namespace, dict]:
    words, values = [*command, "--model", "m"], {}
    words += ["--prompt", "p"] if command == ("generate",) else []
    for o in opts:
        values[o.name], flag = _sample(o)
        words += flag
    return build_parser().parse_args(words), values


def _at(config, o: Option):
    for part in o.path:
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("command", list(EXPECTED), ids=" ".join)
def test_a_value_on_the_command_line_reaches_the_engine_config(command):
    opts = [o for o in EXPECTED[command] if o.name in ENGINE]
    args, values = _args(command, opts)
    config = build(EngineConfig, engine_kwargs(args, "m"), ENGINE_OPTIONS)
    assert {o.name: _at(config, o) for o in opts} == values


def test_serve_and_fleet_values_reach_their_configs():
    args, values = _args(("serve",), SERVER)
    server, http = server_settings(args, "{{ messages }}")
    got = {o.name: _at(server if o in options(ServerConfig) else http, o) for o in SERVER}
    assert got == values | {"chat_template": "{{ messages }}", "served_model_name": "sample"}
    args, values = _args(("fleet",), FLEET)
    assert {o.name: _at(fleet_config(args), o) for o in FLEET} == values


def test_tri_state_and_vllm_spellings():
    parse = build_parser().parse_args
    base = ["generate", "--model", "m", "--prompt", "p"]
    assert parse(base + ["--enforce-eager"]).enforce_eager is True
    assert parse(base + ["--enforce-eager", "off"]).enforce_eager is False
    assert parse(base).enforce_eager is None
    assert parse(base + ["--sync"]).pipelined is False
    assert parse(base + ["--no-snapshot-publish"]).snapshot_publish is False
    assert parse(base + ["--num-gpu-blocks-override", "9"]).num_kv_blocks == 9
    assert parse(base + ["-q", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parse(base + ["--pretune-attention", "maybe"])


def test_serve_defaults_differ_where_declared():
    args = build_parser().parse_args(["serve"])
    assert engine_kwargs(args) == {"max_step_ms": 250.0}
    assert args.engine_process == "auto" and LaunchConfig(engine={}).engine_process == "off"


def test_readme_serve_synopsis_matches_help():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^warmboot serve (.*?)^warmboot (?!serve)", readme, re.S | re.M)
    shown = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", block.group(1)))
    parser = _subparser(("serve",))
    accepted = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    primary = {a.option_strings[0] for a in parser._actions if a.option_strings}
    primary -= {"-h"} | {s for s in primary if s.startswith("--no-")}
    assert shown <= accepted, f"the README shows options serve lacks: {shown - accepted}"
    assert primary <= shown, f"serve options the README leaves out: {primary - shown}"


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dtype='fp16': use one of auto, float32"):
        EngineConfig(model="m", dtype="fp16")
    with pytest.raises(ValueError, match=r"unknown LLM settings \['max_num_seq'\]"):
        FleetConfig(model_id="m", model_source="/m", engine_kwargs={"max_num_seq": 4})
    with pytest.raises(TypeError, match="unexpected settings: bogus"):
        build(EngineConfig, {"model": "m", "bogus": 1})
