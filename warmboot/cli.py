"""Command line: ``warmboot generate | serve | demo | fleet | snapshot``."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warmboot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--model", required=True, help="directory of a Hugging Face-format model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _engine_args(gen)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("--model", default=None, help="model directory (default: built-in)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--tool-call-parser", default="auto",
                     choices=["auto", "hermes", "llama3_json", "mistral"],
                     help="how the model writes tool calls (auto: read the chat template)")  # fmt: skip
    srv.add_argument("--served-model-name", default=None, help="model id (default: dir name)")
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20)
    srv.add_argument("--debug-endpoints", action="store_true", help="enable GET /debug/engine")
    srv.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to render chats with instead of the tokenizer's: a path to a "
        "Jinja file, or the template itself (as vLLM's flag)",
    )
    srv.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (refused with a 400 otherwise)",
    )
    _limit_args(srv)
    _sandbox_arg(srv, engine_process=True)
    _engine_args(srv)
    demo = sub.add_parser("demo", help="create the built-in model if needed and run it")
    demo.add_argument("--model", default=None, help="model directory (default: built-in)")
    demo.add_argument("--max-tokens", type=int, default=32)
    _sandbox_arg(demo)
    _engine_args(demo)
    from warmboot.fleet.cli import add_fleet_parser, run_fleet_cli
    from warmboot.snapshot.cli import add_snapshot_parser, run_snapshot

    add_snapshot_parser(sub)
    add_fleet_parser(sub)
    args = parser.parse_args(argv)
    _setup_logging(args)
    if args.command == "snapshot":
        return run_snapshot(args)
    try:
        commands = {"generate": _generate, "demo": _demo, "serve": _serve, "fleet": run_fleet_cli}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


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


def _limit_args(p: argparse.ArgumentParser) -> None:
    """Admission control and HTTP limits (``server.config.AdmissionLimits``,
    ``server.http_server.HttpLimits``): past them a call gets a 429, 400, 408 or 431."""
    g = p.add_argument_group("limits")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="sequences that may wait beyond --max-num-seqs; past it a 429 with "
                   "Retry-After")  # fmt: skip
    g.add_argument("--max-queued-tokens", type=int, default=1 << 18,
                   help="prompt tokens that may be in flight; past it a 429")  # fmt: skip
    g.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="prompts in one completions call (a 400 past it)")  # fmt: skip
    g.add_argument("--max-header-bytes", type=int, default=64 << 10,
                   help="request line and headers (a 431 past it)")  # fmt: skip
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's head may take to arrive (then the connection "
                   "is closed)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall (a 408)")  # fmt: skip
    g.add_argument("--max-connections", type=int, default=1000,
                   help="open connections; past it the longest idle one is closed")  # fmt: skip
    g.add_argument("--max-step-ms", type=float, default=DEFAULT_MAX_STEP_MS,
                   help="longest an engine step should run: its token budget follows the "
                   "measured step cost, so a request arriving mid-step waits about this long "
                   "at most (0: no cap, throughput first)")  # fmt: skip
    g.add_argument("--client-id-header", default=None,
                   help="a header that names the client, set by a trusted proxy (fair "
                   "scheduling and per-client shares; default: the peer address)")  # fmt: skip


def _limits(args):
    """(admission limits, HTTP limits) from the command line."""
    from warmboot.server.config import AdmissionLimits
    from warmboot.server.http_server import HttpLimits

    admission = AdmissionLimits(
        max_num_seqs=args.max_num_seqs, max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_prompts_per_request=args.max_prompts_per_request)  # fmt: skip
    http = HttpLimits(
        max_header_bytes=args.max_header_bytes, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, max_connections=args.max_connections)  # fmt: skip
    return admission, http


def _sandbox_arg(p: argparse.ArgumentParser, engine_process: bool = False) -> None:
    p.add_argument(
        "--sandbox",
        default="auto",
        choices=["auto", "none"],
        help="auto: with a snapshot store and runsc, run the engine in a gVisor worker and "
        "restore it from a process snapshot; none: never gVisor",
    )
    if engine_process:
        p.add_argument(
            "--engine-process",
            default="auto",
            choices=["auto", "on", "off"],
            help="the engine out of gVisor: on: in a child process, so the HTTP front end "
            "never slows its steps (and keeps off its cores); off: in this process; auto: "
            "on when it runs on the CPU",
        )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "-q",
        "--quantization",
        default=None,
        help="auto (the checkpoint's), a method it must match (gptq, awq, compressed-tensors, "
        "fp8, mxfp4), or fp8 / int8 to quantize a full-precision checkpoint at load",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    loop = p.add_mutually_exclusive_group()
    loop.add_argument(
        "--sync",
        dest="pipelined",
        action="store_false",
        default=None,
        help="use the sync decode loop",
    )
    loop.add_argument(
        "--pipelined",
        dest="pipelined",
        action="store_true",
        help="use the pipelined decode loop (default on CUDA and >= 4 cores)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="run the model steps eagerly, op by op. Without it (the default) the steps are "
        "compiled with torch.compile on the CPU (a compile at start-up, seconds to a minute, "
        "then 1.2-1.6x faster decode) and captured as CUDA graphs on CUDA",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch compute threads on the CPU (default: the thread policy, all cores but "
        "one for the host loop, pinned where the OS allows)",
    )
    _snapshot_args(p)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log more: every warmboot INFO line (serve shows its start-up phases without -v)",
    )


def _snapshot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--snapshot-store",
        default=None,
        help="tier-A snapshot store (dir or s3://bucket/prefix): start the way measured quicker "
        "here (restore, or boot cold; WARMBOOT_START_BY_COST=0: restore), publish if none matches",
    )
    p.add_argument(
        "--no-snapshot-publish",
        dest="snapshot_publish",
        action="store_false",
        help="with --snapshot-store: restore if possible but never publish",
    )
    p.add_argument(
        "--snapshot-timeout",
        type=float,
        default=30.0,
        help="seconds a snapshot lookup, restore or publish may go without progress before "
        "it is abandoned (then: a cold boot, or no publish)",
    )
    p.add_argument(
        "--pretune-attention",
        choices=["auto", "on", "off"],
        default="auto",
        help="tune the Triton prefill kernel for every sequence-length bucket at start-up "
        "(CUDA); auto: only before publishing a snapshot, which then carries the results",
    )


def _engine_kwargs(args, model: str) -> dict:
    """``LLM`` keyword arguments from the command line (plain JSON data: a worker gets them)."""
    kwargs = dict(
        model=model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        pipelined=args.pipelined,
        enforce_eager=args.enforce_eager,
        cpu_threads=args.cpu_threads,
        snapshot_store=args.snapshot_store,
        snapshot_publish=args.snapshot_publish,
        snapshot_timeout=args.snapshot_timeout,
        pretune_attention={"auto": None, "on": True, "off": False}[args.pretune_attention],
    )
    if hasattr(args, "max_num_seqs"):
        kwargs["max_num_seqs"] = args.max_num_seqs
    if getattr(args, "max_step_ms", None):
        kwargs["max_step_ms"] = args.max_step_ms
    return kwargs


def _generate(args) -> int:
    from warmboot import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args, args.model))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
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
    # NOTE: the engine starts (or a restore runs) while the HTTP stack below is imported,
    # once its path is chosen: its imports slowed the launcher's key and lookup (GIL)
    chosen = threading.Event()
    boot = functools.partial(_boot, args, cpus, chosen, hint)
    holder = EngineHolder(boot, started_at=started_at, freeze_gc=True)
    holder.start()
    chosen.wait(CHOOSE_WAIT_S)
    from warmboot.server.serve import serve

    config, http_limits = _server_config(args, chat_template)

    def listening(url: str) -> None:
        name = config.served_model_name
        print(f"serving {name!r} on {url}/v1 (/health: 503 until the engine is ready)", flush=True)

    code = 0
    try:
        serve(holder, config, args.host, args.port, "info" if args.verbose else "warning",
              listening, http_limits)  # fmt: skip
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


def _server_config(args, chat_template: str | None):
    """(``ServerConfig``, HTTP limits) from the command line."""
    from warmboot.server.app import ServerConfig
    from warmboot.server.serve import default_model_name

    admission, http_limits = _limits(args)
    config = ServerConfig(
        served_model_name=args.served_model_name or default_model_name(args.model),
        api_key=args.api_key or os.environ.get("WARMBOOT_API_KEY") or None,
        tool_call_parser=args.tool_call_parser,
        max_body_bytes=args.max_body_bytes,
        enable_debug=args.debug_endpoints,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        admission=admission,
        client_id_header=args.client_id_header,
    )
    return config, http_limits


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

    cfg = LaunchConfig(engine=_engine_kwargs(args, args.model), store=args.snapshot_store,
                       sandbox=args.sandbox, engine_process=args.engine_process,
                       engine_cpus=cpus, place_front=True, on_path=on_path,
                       on_recorded=functools.partial(spare_hints.remember, hint,
                                                     store=args.snapshot_store))  # fmt: skip
    try:
        return launch(cfg)
    finally:
        chosen.set()


def _demo(args) -> int:
    from warmboot.launcher.demo import run_demo
    from warmboot.models.demo import ensure_default_model

    t0 = time.perf_counter()
    model = args.model or str(ensure_default_model())
    print(f"model: {model} (ready in {time.perf_counter() - t0:.1f}s)", flush=True)
    return run_demo(_engine_kwargs(args, model), args.sandbox, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
