"""``warmboot fleet``: the OpenAI API on Ray Serve, in front of replicas that scale from zero
and restore from the shared snapshot store. Registering the parser imports neither Ray nor
torch."""

from __future__ import annotations

import json
import sys


def add_fleet_parser(sub) -> None:
    p = sub.add_parser("fleet", help="serve a model on Ray Serve, replicas scaling from zero")
    p.add_argument("--model", default=None, help="model directory (default: built-in)")
    p.add_argument("--served-model-name", default=None, help="model id (default: dir name)")
    p.add_argument("--snapshot-store", default=None,
                   help="shared store: a directory every node sees, or s3://bucket/prefix")  # fmt: skip
    p.add_argument("--min-replicas", type=int, default=0)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--target-ongoing-requests", type=int, default=8,
                   help="requests per replica before another starts (its batch)")  # fmt: skip
    p.add_argument("--downscale-delay", type=float, default=30.0, help="idle seconds first")
    p.add_argument("--max-queued-requests", type=int, default=64)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="join this Ray cluster (default: local)")
    p.add_argument("--sandbox", choices=["auto", "none"], default="auto")
    p.add_argument("--api-key", default=None)
    p.add_argument("--engine-kwargs", default="{}", help="LLM keyword arguments, as JSON")
    p.add_argument("-v", "--verbose", action="store_true")


def run_fleet_cli(args) -> int:
    from pathlib import Path

    from warmboot.fleet.app import run_fleet
    from warmboot.fleet.config import AutoscalingConfig, FleetConfig

    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = str(ensure_default_model())
    cfg = FleetConfig(
        model_id=args.served_model_name or Path(args.model).resolve().name,
        model_source=str(Path(args.model).resolve()),
        engine_kwargs=json.loads(args.engine_kwargs),
        snapshot_store=args.snapshot_store,
        autoscaling=AutoscalingConfig(
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            downscale_delay_s=args.downscale_delay,
        ),
        max_queued_requests=args.max_queued_requests,
        drain_timeout_s=args.drain_timeout,
        sandbox=args.sandbox,
        api_key=args.api_key,
    )
    print(f"fleet {cfg.model_id!r} on http://127.0.0.1:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        run_fleet(cfg, args.port, args.address)
    except KeyboardInterrupt:
        pass
    finally:
        from warmboot.fleet.app import shutdown

        shutdown()
    return 0
