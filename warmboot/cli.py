"""Command line: ``warmboot generate | serve | demo | fleet | snapshot``. Each setting's
option is derived from its config dataclass (``warmboot.options``): one name, default and
help text on every command line and in ``LLM``'s keyword arguments."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import threading
import time
from dataclasses import replace

from warmboot.engine_options import add_engine_options, engine_kwargs
from warmboot.options import Option, add_options, build, given, options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    if args.command == "snapshot":
        from warmboot.snapshot.cli import run_snapshot

        return run_snapshot(args)
    try:
        commands = {"generate": _generate, "demo": _demo, "serve": _serve, "fleet": _fleet}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; each setting's option comes from its config dataclass."""
    from warmboot.fleet.cli import add_fleet_parser
    from warmboot.snapshot.cli import add_snapshot_parser

    parser = argparse.ArgumentParser(prog="warmboot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--model", required=True, help="directory of a Hugging Face-format model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_options(gen)
    _serve_parser(sub)
    demo = sub.add_parser("demo", help="create the built-in model if needed and run it")
    demo.add_argument("--model", default=None, help="model directory (default: built-in)")
    demo.add_argument("--max-tokens", type=int, default=32)
    add_options(demo, [o for o in launch_options() if o.name == "sandbox"])
    add_engine_options(demo)
    add_snapshot_parser(sub)
    add_fleet_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    from warmboot.server.config import LIMITS, HttpLimits, ServerConfig

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("--model", default=None, help="model directory (default: built-in)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    add_options(srv, options(ServerConfig) + options(HttpLimits, LIMITS))
    add_options(srv, launch_options(), SERVE_DEFAULTS)
    add_engine_options(srv, SERVE_DEFAULTS)


def launch_options() -> list[Option]:
    """Where the engine runs (``LaunchConfig``'s settings: ``sandbox``, ``engine_process``)."""
    from warmboot.launcher.launch_config import LaunchConfig

    return options(LaunchConfig)


def _setup_logging(args) -> None:
    """Warnings by default; ``serve`` also shows its start-up phases (warmboot.startup at
    INFO); ``-v``: every warmboot INFO line (uvicorn's too, in ``serve``)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.verbose:
        logging.getLogger("warmboot").setLevel(logging.INFO)
    elif args.command == "serve":
        logging.getLogger("warmboot.startup").setLevel(logging.INFO)


CHOOSE_WAIT_S = 1.0
"""How long ``serve`` holds its HTTP imports back for the launcher to choose the start path."""

DEFAULT_MAX_STEP_MS = 250.0
"""``serve``'s step time cap. On two CPU cores it costs a fifth of a batch's prefill throughput
(100 ms: two fifths; ``bench/step_cap.py``) and keeps steps of seconds (3.7 s there) off the
path of every newcomer and running stream; on a GPU it rarely binds. Offline: none."""


SERVE_DEFAULTS = {"max_step_ms": DEFAULT_MAX_STEP_MS, "engine_process": "auto"}
"""Where ``serve``'s defaults differ from the settings' own (offline ones)."""


def _generate(args) -> int:
    from warmboot import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args, args.model))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    t0 = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    elapsed = time.perf_counter() - t0
    c = out.outputs[0]
    if args.json:
        record = {
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "seconds": round(elapsed, 4),
            "startup_seconds": {k: round(v, 4) for k, v in llm.stats()["startup_times"].items()},
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(c.text)
    return 0


def _serve(args) -> int:
    from warmboot.device.threads import usable_cpus
    from warmboot.launcher import engine_process, local, spare_hints

    cpus = tuple(usable_cpus())
    hint = spare_hints.launch_id(args.model, args.snapshot_store, args.sandbox)
    if local.in_child(args.engine_process, {"device": args.device}):  # NOTE: a spare imports torch
        engine_process.prestart(cpus, args.cpu_threads, hint, args.snapshot_store)
    from warmboot.server.config import read_chat_template
    from warmboot.server.engine_holder import EngineHolder, process_age, unservable

    started_at = time.monotonic() - process_age()
    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = str(ensure_default_model())
    reason = unservable(args.model, args.quantization)
    if reason is not None:
        print(f"error: cannot serve {args.model}: {reason}", file=sys.stderr)
        return 2
    chat_template = read_chat_template(args.chat_template)
    adapters = _lora_modules(args)
    # NOTE: the engine starts (or a restore runs) while the HTTP stack below is imported,
    # once its path is chosen: its imports slowed the launcher's key and lookup (GIL)
    chosen = threading.Event()
    boot = functools.partial(_boot, args, cpus, chosen, hint)
    holder = EngineHolder(boot, started_at=started_at, freeze_gc=True)
    if adapters:  # NOTE: read as the engine boots: a bad one fails the start (exit 2)
        from warmboot.server.adapters import load_modules

        holder.prepare = functools.partial(load_modules, adapters)
    holder.start()
    chosen.wait(CHOOSE_WAIT_S)
    from warmboot.server.serve import serve

    config, http_limits = server_settings(args, chat_template)

    def listening(url: str) -> None:
        name = config.served_model_name
        print(f"serving {name!r} on {url}/v1 (/health: 503 until the engine is ready)", flush=True)

    code = 0
    try:
        log_level = "info" if args.verbose else "warning"
        serve(holder, config, args.host, args.port, log_level, listening, http_limits)
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:  # uvicorn's, when it cannot bind
        code = e.code if isinstance(e.code, int) else 1
    if holder.booting():
        holder.abandon(code or 1)
    if holder.fatal is not None:
        print(f"error: cannot serve {args.model}: {holder.fatal}", file=sys.stderr)
        return 2
    return code


def _lora_modules(args) -> list:
    """``--lora-modules`` read (``LoRARequest``s); ``ValueError`` naming a bad item, or the
    option without ``--enable-lora``."""
    from pathlib import Path

    from warmboot.server.adapters import parse_lora_modules

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora: the engine serves adapters only then")
    base = args.served_model_name or Path(args.model).resolve().name
    return parse_lora_modules(args.lora_modules, base)


def server_settings(args, chat_template: str | None):
    """(``ServerConfig``, HTTP limits) from the command line."""
    from warmboot.server.config import HttpLimits, ServerConfig
    from warmboot.server.serve import default_model_name

    values = given(args, options(ServerConfig)) | {
        "served_model_name": args.served_model_name or default_model_name(args.model),
        "api_key": args.api_key or os.environ.get("WARMBOOT_API_KEY") or None,
        "chat_template": chat_template,
    }
    config = build(ServerConfig, values)
    seats = replace(config.admission, max_num_seqs=args.max_num_seqs)
    return replace(config, admission=seats), build(HttpLimits, given(args, options(HttpLimits)))


def _boot(args, cpus: tuple[int, ...], chosen: threading.Event, hint: str | None):
    """``serve``'s engine (again for a restart); ``cpus``: this process's at start, before
    an engine process moved it off some; ``chosen`` is set once its start path is. Kept for
    the next start under ``hint`` (``spare_hints``): where the engine runs, then, once this
    start's cost is on record, where the next one will run it."""
    from warmboot.launcher import spare_hints
    from warmboot.launcher.launch import LaunchConfig, launch

    def on_path(sandboxed: bool) -> None:
        chosen.set()
        spare_hints.remember(hint, sandboxed)

    recorded = functools.partial(spare_hints.remember, hint, store=args.snapshot_store)
    cfg = LaunchConfig(
        engine=engine_kwargs(args, args.model),
        store=args.snapshot_store,
        sandbox=args.sandbox,
        engine_process=args.engine_process,
        engine_cpus=cpus,
        place_front=True,
        on_path=on_path,
        on_recorded=recorded,
    )
    try:
        return launch(cfg)
    finally:
        chosen.set()


def _fleet(args) -> int:
    from warmboot.fleet.cli import run_fleet_cli

    return run_fleet_cli(args)


def _demo(args) -> int:
    from warmboot.launcher.demo import run_demo
    from warmboot.models.demo import ensure_default_model

    t0 = time.perf_counter()
    model = args.model or str(ensure_default_model())
    print(f"model: {model} (ready in {time.perf_counter() - t0:.1f}s)", flush=True)
    return run_demo(engine_kwargs(args, model), args.sandbox, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
