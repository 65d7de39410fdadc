"""Build the fleet's Serve application, and run it on a local Ray (loopback) or a cluster.

    from warmboot.fleet.app import build_app
    from warmboot.fleet.config import FleetConfig
    serve.run(build_app(FleetConfig.from_llm_config({...})), route_prefix="/")

The scale-up decision waits on queue metrics that handles and replicas push every
``metrics_interval_s``; Serve reads that interval from the environment of its processes, so
``start_ray`` sets it before Ray starts (a cluster that is joined must have it set already).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from warmboot.fleet.config import FleetConfig

log = logging.getLogger("warmboot")
APP_NAME = "warmboot"
INGRESS = "WarmbootIngress"
REPLICA = "WarmbootReplica"
RAY_CONNECT_TIMEOUT_S = 10.0


def build_app(cfg: FleetConfig, app_name: str = APP_NAME):
    """The Serve application: the ingress bound to the autoscaled replica deployment."""
    from ray import serve

    from warmboot.fleet.ingress import Ingress
    from warmboot.fleet.replica import Replica

    scaling = cfg.autoscaling
    replica = serve.deployment(
        Replica,
        name=REPLICA,
        max_ongoing_requests=scaling.max_ongoing_requests or 2 * scaling.target_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        graceful_shutdown_timeout_s=cfg.drain_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_cpus": cfg.replica_cpus},
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "initial_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": max(
                2 * scaling.metrics_interval_s, min(10.0, scaling.downscale_delay_s / 2)
            ),
            # NOTE: deprecated, yet what a handle's router still pushes its queue on: its
            # default (10 s) held the decision to leave zero for seconds after the first time
            "metrics_interval_s": scaling.metrics_interval_s,
        },
    )
    # NOTE: the ingress takes every request at once (Serve's default of 5 would queue the
    # rest in the proxy, unbounded): it bounds the queue itself, with a 503 and Retry-After
    ingress = serve.deployment(
        Ingress,
        name=INGRESS,
        num_replicas=1,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
    )
    config_json = cfg.to_json()
    return ingress.bind(
        config_json, replica.bind(config_json, INGRESS, app_name), REPLICA, app_name
    )


def build_openai_app(config: dict, app_name: str = APP_NAME):
    """``ray.serve.llm.build_openai_app``'s shape: ``{"llm_configs": [LLMConfig-shaped dict]}``
    (one model per fleet for now)."""
    configs = config.get("llm_configs", [])
    if len(configs) != 1:
        raise ValueError(f"a warmboot fleet serves one model; got {len(configs)} llm_configs")
    return build_app(FleetConfig.from_llm_config(configs[0]), app_name)


def serve_env(cfg: FleetConfig) -> dict[str, str]:
    """What Serve's processes must see in their environment."""
    interval = str(cfg.autoscaling.metrics_interval_s)
    return {
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": interval,
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": interval,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def start_ray(cfg: FleetConfig, address: str | None = None, num_cpus: int | None = None):
    """A local Ray on loopback (``address`` None), or join ``address`` (host:port or
    ray://host:port): an address that does not answer within ``RAY_CONNECT_TIMEOUT_S``
    raises instead of leaving ``ray.init`` to hang. (``ray.init`` runs on the calling
    thread: from another thread its core worker never reaches the GCS here.)"""
    os.environ.update(serve_env(cfg))
    import ray

    if ray.is_initialized():
        return
    kwargs = {"include_dashboard": False, "log_to_driver": False}
    if address is None:
        replicas = int(cfg.autoscaling.max_replicas * cfg.replica_cpus) + 1
        kwargs["num_cpus"] = num_cpus or max(os.cpu_count() or 1, replicas)
    else:
        _check_reachable(address)
        kwargs["address"] = address
    ray.init(**kwargs)


def _check_reachable(address: str) -> None:
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), RAY_CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"Ray at {address} does not answer: {e}") from None


def run_fleet(cfg: FleetConfig, port: int, address: str | None = None, blocking: bool = True):
    """Start (or join) Ray, serve the fleet on 127.0.0.1:``port``; blocks unless told not to."""
    from ray import serve

    start_ray(cfg, address)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    log.info("fleet %s on http://127.0.0.1:%d/v1", cfg.model_id, port)
    if blocking:
        threading.Event().wait()


def shutdown() -> None:
    """Stop the fleet (its replicas drain) and the Ray this process started. Idempotent."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
