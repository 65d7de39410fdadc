"""``warmboot fleet``: the OpenAI API on Ray Serve, in front of replicas that scale from zero
and restore from the shared snapshot store. Registering the parser imports neither Ray nor
torch."""

from __future__ import annotations

import json
import sys

from warmboot.engine_options import add_engine_options, engine_kwargs
from warmboot.fleet.config import FleetConfig
from warmboot.options import add_options, build, given, options

FLEET_OWN = ("snapshot_store",)
"""Engine settings the fleet sets itself: every replica's engine uses the fleet's store."""


def add_fleet_parser(sub) -> None:
    p = sub.add_parser("fleet", help="serve a model on Ray Serve, replicas scaling from zero")
    p.add_argument("--model", default=None, help="model directory (default: built-in)")
    p.add_argument("--served-model-name", default=None, help="model id (default: dir name)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="join this Ray cluster (default: local)")
    add_options(p, options(FleetConfig))
    p.add_argument(
        "--engine-kwargs",
        default="{}",
        help="more LLM keyword arguments, as JSON (the engine options above take precedence)",
    )
    add_engine_options(p, leave_out=FLEET_OWN)


def fleet_config(args) -> FleetConfig:
    """The fleet's settings from the command line (the engine's among ``engine_kwargs``)."""
    from pathlib import Path

    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = str(ensure_default_model())
    values = given(args, options(FleetConfig)) | {
        "model_id": args.served_model_name or Path(args.model).resolve().name,
        "model_source": str(Path(args.model).resolve()),
        "engine_kwargs": json.loads(args.engine_kwargs) | engine_kwargs(args, leave_out=FLEET_OWN),
    }
    return build(FleetConfig, values)


def run_fleet_cli(args) -> int:
    from warmboot.fleet.app import run_fleet

    cfg = fleet_config(args)
    print(f"fleet {cfg.model_id!r} on http://127.0.0.1:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        run_fleet(cfg, args.port, args.address)
    except KeyboardInterrupt:
        pass
    finally:
        from warmboot.fleet.app import shutdown

        shutdown()
    return 0
