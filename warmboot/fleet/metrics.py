"""The fleet's view of itself, for ``/health`` and ``/metrics``: replica counts by state from
the Serve controller (asked by the ingress, so no replica wakes up), the scale-up decisions it
saw and how long each took from the first waiting request, and what every replica reported
(its start path and seconds, its own metrics)."""

from __future__ import annotations

import time
from collections import Counter

STALE_REPORT_S = 10.0
START_FIELDS = ("path", "seconds", "reason", "began", "ready")
"""What /health shows of each replica start (``began`` / ``ready``: wall-clock seconds)."""
STATES = ("STARTING", "RUNNING", "STOPPING", "RECOVERING", "UPDATING")


class FleetView:
    def __init__(self, deployment: str, app_name: str):
        self.deployment, self.app_name = deployment, app_name
        self.replicas: dict[str, int] = dict.fromkeys(STATES, 0)
        self.reports: dict[str, dict] = {}
        self.starts: dict[str, dict] = {}
        """Every replica start seen: id -> {path, seconds}."""
        self.scale_ups = 0
        self.decision_s: list[float] = []
        self._waiting_since: float | None = None
        self._live = 0

    def note_waiting(self) -> None:
        """A request arrived: if no replica is up or starting, the clock for the scale-up
        decision starts now."""
        if self._live == 0 and self._waiting_since is None:
            self._waiting_since = time.monotonic()

    def refresh(self, waiting: int) -> None:
        from ray import serve

        status = serve.status().applications.get(self.app_name)
        deployment = status.deployments.get(self.deployment) if status else None
        counts = {
            str(getattr(k, "value", k)): n
            for k, n in (deployment.replica_states.items() if deployment else ())
        }
        self.replicas = {s: counts.get(s, 0) for s in STATES}
        live = self.replicas["STARTING"] + self.replicas["RUNNING"] + self.replicas["RECOVERING"]
        if live > self._live:
            self.scale_ups += 1
            if self._waiting_since is not None:
                self.decision_s.append(time.monotonic() - self._waiting_since)
        if live > 0:
            self._waiting_since = None
        self._live = live
        for rid, rep in list(self.reports.items()):  # NOTE: reports arrive on another thread
            self.starts[rid] = rep["start"]

    def live_reports(self) -> list[dict]:
        now = time.time()
        return [r for r in list(self.reports.values()) if now - r.get("time", 0) < STALE_REPORT_S]

    def health(self, model: str, waiting: int) -> dict:
        paths = Counter(s["path"] for s in self.starts.values())
        return {
            "status": "ok",
            "model": model,
            "replicas": {k.lower(): v for k, v in self.replicas.items()},
            "waiting": waiting,
            "scale_ups": self.scale_ups,
            "starts_by_path": dict(paths),
            "starts": [
                {"replica": rid, **{k: s.get(k) for k in START_FIELDS}}
                for rid, s in sorted(self.starts.items(), key=lambda i: i[1].get("began", 0))
            ],
        }


def render_metrics(view: FleetView, waiting: int) -> str:
    lines = [
        "# HELP warmboot_fleet_replicas Replicas of the fleet by state (the Serve controller's)",
        "# TYPE warmboot_fleet_replicas gauge",
        *(f'warmboot_fleet_replicas{{state="{s.lower()}"}} {n}' for s, n in view.replicas.items()),
        "# HELP warmboot_fleet_waiting_requests Requests waiting for a replica",
        "# TYPE warmboot_fleet_waiting_requests gauge",
        f"warmboot_fleet_waiting_requests {waiting}",
        "# HELP warmboot_fleet_scale_ups_total Scale-up decisions seen",
        "# TYPE warmboot_fleet_scale_ups_total counter",
        f"warmboot_fleet_scale_ups_total {view.scale_ups}",
        "# HELP warmboot_fleet_scale_up_decision_seconds Seconds from the first waiting request "
        "to the scale-up decision, the last one",
        "# TYPE warmboot_fleet_scale_up_decision_seconds gauge",
        f"warmboot_fleet_scale_up_decision_seconds {view.decision_s[-1] if view.decision_s else 0}",
        "# HELP warmboot_fleet_replica_start_seconds Seconds each replica took to start, by path "
        "(cold, restored_image, restored_process)",
        "# TYPE warmboot_fleet_replica_start_seconds gauge",
    ]
    for rid, start in sorted(view.starts.items()):
        lines.append(
            f'warmboot_fleet_replica_start_seconds{{replica="{rid}",'
            f'path="{start["path"]}"}} {start["seconds"]:.3f}'
        )
    lines += _replica_families(view.live_reports())
    return "\n".join(lines) + "\n"


def _replica_families(reports: list[dict]) -> list[str]:
    """Every replica's own metrics, merged family by family with a ``replica`` label."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for rep in reports:
        for fam in text_string_to_metric_families(rep.get("metrics", "")):
            entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for sample in fam.samples:
                labels = {**sample.labels, "replica": rep["id"]}
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                entry[2].append(f"{sample.name}{{{text}}} {sample.value}")
    out = []
    for name, (kind, doc, samples) in sorted(families.items()):
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples]
    return out


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
