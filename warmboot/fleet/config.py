"""The fleet's settings, shaped like ``ray.serve.llm``'s ``LLMConfig``:

    {"model_loading_config": {"model_id": "demo", "model_source": "/models/demo"},
     "engine_kwargs": {"dtype": "bfloat16", "max_num_seqs": 8},
     "deployment_config": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
     "snapshot_store": "s3://bucket/prefix"}

plus warmboot's own fields. Plain data (JSON in, JSON out): replicas get it as a string.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace

from warmboot.config import ENGINE_DEFAULTS
from warmboot.options import check_choices, setting

SCALING = "autoscaling"
"""The ``--help`` group of the autoscaling settings."""


@dataclass(frozen=True)
class AutoscalingConfig:
    min_replicas: int = setting(0, "replicas kept when idle (0: scale to zero)")
    max_replicas: int = setting(2, "most replicas")
    target_ongoing_requests: int = setting(
        8, "requests per replica before another starts (its batch)"
    )
    """Its batch (``max_num_seqs``), so a burst scales to the need at once rather than
    0 -> 1 -> 2 with a wasted boot."""
    max_ongoing_requests: int | None = setting(
        None,
        "requests one replica runs at once; more wait in the handles' queues (default: twice "
        "the target)",
    )
    upscale_delay_s: float = setting(
        0.0, "seconds of demand before a replica is added", flag="--upscale-delay"
    )
    downscale_delay_s: float = setting(
        30.0, "idle seconds before a replica goes (to zero included)", flag="--downscale-delay"
    )
    metrics_interval_s: float = setting(
        0.25,
        "how often handles and replicas report their queues, in seconds",
        flag="--metrics-interval",
    )
    """Serve's default, 10 s, delays the decision to leave zero by up to that long."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas} / {self.max_replicas}"
            )
        if self.target_ongoing_requests < 1 or self.metrics_interval_s <= 0:
            raise ValueError("target_ongoing_requests must be >= 1, metrics_interval_s > 0")


@dataclass(frozen=True)
class FleetConfig:
    model_id: str
    """The name clients send as ``model``."""
    model_source: str
    """The model directory (the same path on every node)."""
    engine_kwargs: dict = field(default_factory=dict)
    """``LLM`` keyword arguments (``model`` and ``snapshot_store`` are set by the fleet)."""
    snapshot_store: str | None = setting(
        None, "the shared store: a directory every node sees, or s3://bucket/prefix"
    )
    autoscaling: AutoscalingConfig = setting(factory=AutoscalingConfig, group=SCALING)
    max_queued_requests: int = setting(
        64, "requests waiting for a replica; past it a 503 with Retry-After"
    )
    request_timeout_s: float = setting(
        300.0, "seconds a request may wait for a replica (then a 503)", flag="--request-timeout"
    )
    drain_timeout_s: float = setting(
        60.0,
        "seconds a replica scaled down has to finish its streams; one still running then ends "
        "with an error event, never a silent cut",
        flag="--drain-timeout",
    )
    sandbox: str = setting(
        "auto",
        "gVisor and process snapshots where runsc works (auto), or never (none)",
        choices=("auto", "runsc", "none"),
    )
    node_cache_dir: str | None = setting(
        None, "per-node chunk cache in front of an S3 store (default: under the warmboot cache)"
    )
    node_cache_bytes: int = setting(64 << 30, "the per-node chunk cache's size in bytes")
    replica_cpus: float = setting(1.0, "CPUs Ray reserves for each replica")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'")

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1 or self.drain_timeout_s <= 0:
            raise ValueError("max_queued_requests must be >= 1 and drain_timeout_s > 0")
        check_choices(self)
        if unknown := sorted(set(self.engine_kwargs) - set(ENGINE_DEFAULTS)):
            raise ValueError(f"engine_kwargs: unknown LLM settings {unknown}")
        if "snapshot_store" in self.engine_kwargs:
            raise ValueError("engine_kwargs: snapshot_store is the fleet's own setting")

    @classmethod
    def from_llm_config(cls, doc: dict) -> FleetConfig:
        """From the ``LLMConfig`` shape (unknown keys are errors, named)."""
        doc = dict(doc)
        loading = doc.pop("model_loading_config", {})
        deployment = dict(doc.pop("deployment_config", {}))
        scaling = AutoscalingConfig(**deployment.pop("autoscaling_config", {}))
        for key in ("max_queued_requests", "graceful_shutdown_timeout_s"):
            if key in deployment:
                doc["drain_timeout_s" if "graceful" in key else key] = deployment.pop(key)
        if deployment:
            raise ValueError(f"unsupported deployment_config keys: {sorted(deployment)}")
        known = {f.name for f in fields(cls)}
        if unknown := set(doc) - known:
            raise ValueError(f"unsupported fleet config keys: {sorted(unknown)}")
        return cls(
            model_id=loading.get("model_id") or loading["model_source"],
            model_source=loading["model_source"],
            autoscaling=scaling,
            **doc,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FleetConfig:
        doc = json.loads(text)
        return cls(**{**doc, "autoscaling": AutoscalingConfig(**doc["autoscaling"])})

    def engine(self, store: str | None) -> dict:
        """The replica engine's ``LLM`` keyword arguments, with the store it should use."""
        return {**self.engine_kwargs, "model": self.model_source, "snapshot_store": store}

    def with_(self, **changes) -> FleetConfig:
        return replace(self, **changes)
