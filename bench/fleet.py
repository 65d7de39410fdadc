"""The fleet on a bursty trace: time to first token, failed or cut requests and replica-seconds
(the cost), same run, same model (the built-in demo model), this machine.

Configurations, each on a fresh local Ray:

* ``always-on``: one replica that never goes (min = max = 1), started before the trace;
* ``fleet, cold``: scale from zero, no snapshot store (every replica boots cold);
* ``fleet, local store``: scale from zero restoring from a local store (tier P where runsc
  works, else tier A), published by a warm-up start before the trace;
* ``fleet, S3 + node cache``: the same snapshots in an S3-protocol server (moto), an empty
  node cache at the start: the first replica pulls, later ones find the chunks on disk.

The trace: ``--bursts`` bursts of ``--burst-size`` concurrent streamed completions, an idle gap
longer than the downscale delay between them. Replica-seconds integrate the replicas that
exist (starting, running, stopping) over the trace, polled from the fleet's ``/health``. The
reference for "first token from zero" is a single process started with the same engine
settings that restores from the same local store (what ``warmboot serve`` does), timed from
process start to its first token.

Writes ``docs/benchmarks/fleet.{json,md,png}``. ``python -m bench.fleet``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import rounded_rank as percentile

PORT = 18790
ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "cpu_threads": 1}
SINGLE_SCRIPT = """
import json, sys, time
t0 = float(sys.argv[3])
from warmboot.launcher.launch import LaunchConfig, launch
from warmboot.sampling_params import SamplingParams
import asyncio
engine = json.loads(sys.argv[1])
client = launch(LaunchConfig(engine=engine, store=sys.argv[2]))
async def first():
    s = await client.add_request("Hello", SamplingParams(max_tokens=1, temperature=0.0))
    async for _ in s:
        return time.time()
t = asyncio.run(first())
print(json.dumps({"ttft_s": t - t0, "path": client.start_info.path}))
client.shutdown()
"""


async def one_request(base: str, i: int, tokens: int) -> dict:
    import httpx

    body = {
        "model": "demo",
        "prompt": f"Request {i}:",
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0, out = time.monotonic(), {"ok": False, "ttft_s": None, "tokens": 0}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["ok"] = out["tokens"] == tokens
                    elif line.startswith("data: ") and '"error"' not in line:
                        out["ttft_s"] = out["ttft_s"] or time.monotonic() - t0
                        out["tokens"] += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        out["error"] = f"{type(e).__name__}: {e}"
    return out


class ReplicaMeter:
    """Polls ``/health``: replica-seconds, and the replica count over time."""

    def __init__(self, base: str):
        import httpx

        self.client, self.samples = httpx.Client(base_url=base, timeout=10), []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                reps = self.client.get("/health").json()["replicas"]
            except Exception:  # noqa: BLE001 - keep polling
                continue
            self.samples.append(
                (time.monotonic(), reps["starting"] + reps["running"] + reps["stopping"])
            )

    def replica_seconds(self) -> float:
        pairs = zip(self.samples, self.samples[1:], strict=False)
        return sum((t1 - t0) * n for (t0, n), (t1, _) in pairs)


def run_config(name: str, cfg, bursts: int, size: int, gap: float, tokens: int) -> dict:
    from warmboot.fleet import app as fleet_app

    subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "stop", "--force"],
        capture_output=True,
        timeout=120,
    )
    fleet_app.run_fleet(cfg, PORT, blocking=False)
    base = f"http://127.0.0.1:{PORT}"
    if cfg.autoscaling.min_replicas:
        asyncio.run(one_request(base, -1, 1))  # NOTE: the always-on replica is up before
    meter = ReplicaMeter(base)
    meter.thread.start()
    results, t_start = [], time.monotonic()
    for b in range(bursts):
        burst = asyncio.run(_burst(base, b, size, tokens))
        results += [r | {"burst": b, "first_of_burst": i == 0} for i, r in enumerate(burst)]
        if b < bursts - 1:
            time.sleep(gap)
    time.sleep(gap)  # NOTE: the fleet goes back to zero, counted in its cost
    meter.stop.set()
    duration = time.monotonic() - t_start
    health = meter.client.get("/health").json()
    fleet_app.shutdown()
    return _summary(name, results, meter, duration, health)


async def _burst(base: str, b: int, size: int, tokens: int) -> list[dict]:
    return await asyncio.gather(*[one_request(base, b * 100 + i, tokens) for i in range(size)])


def _summary(name, results, meter, duration, health) -> dict:
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    firsts = [
        min(r["ttft_s"] for r in results if r["burst"] == b and r["ttft_s"] is not None)
        for b in {r["burst"] for r in results}
    ]
    return {
        "config": name,
        "requests": len(results),
        "failed_or_cut": sum(not r["ok"] for r in results),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99),
        "first_token_of_burst_s": statistics.mean(firsts) if firsts else None,
        "replica_seconds": meter.replica_seconds(),
        "duration_s": duration,
        "starts": health.get("starts_by_path", {}),
        "timeline": [(t - meter.samples[0][0], n) for t, n in meter.samples]
        if meter.samples
        else [],
        "errors": [r.get("error") for r in results if r.get("error")][:3],
    }


def single_restore_ttft(engine: dict, store: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SINGLE_SCRIPT, json.dumps(engine), store, str(time.time())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--burst-size", type=int, default=6)
    p.add_argument("--gap", type=float, default=40.0, help="idle seconds between bursts")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--downscale-delay", type=float, default=3.0)
    args = p.parse_args()
    from bench.store_fault_cases import s3_server
    from warmboot.fleet.config import AutoscalingConfig, FleetConfig
    from warmboot.models.demo import ensure_default_model
    from warmboot.snapshot.ops import copy_snapshot
    from warmboot.snapshot.store import LocalStore, open_store

    model = str(ensure_default_model())
    tmp = Path(tempfile.mkdtemp(prefix="wb-fleet-"))
    store = tmp / "store"
    scaling = AutoscalingConfig(
        min_replicas=0,
        max_replicas=2,
        target_ongoing_requests=8,
        downscale_delay_s=args.downscale_delay,
    )
    base = FleetConfig(
        model_id="demo",
        model_source=model,
        engine_kwargs=ENGINE,
        autoscaling=scaling,
        node_cache_dir=str(tmp / "node-cache"),
    )
    trace = (args.bursts, args.burst_size, args.gap, args.tokens)
    rows = []
    try:
        always = base.with_(
            autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=1, target_ongoing_requests=8)
        )
        rows.append(run_config("always-on", always, *trace))
        rows.append(run_config("fleet, cold", base.with_(sandbox="none"), *trace))
        local = base.with_(snapshot_store=str(store))
        run_config("warm-up (publishes)", local, 1, 1, args.downscale_delay + 4, 4)
        single = single_restore_ttft(local.engine(str(store)), str(store))
        rows.append(run_config("fleet, local store", local, *trace))
        golden = LocalStore(store)
        with s3_server(store) as s3:  # NOTE: copies one key; the rest follow
            s3_store = open_store(s3["s3"])
            for key in golden.list_keys():
                copy_snapshot(golden, s3_store, key)
            rows.append(
                run_config("fleet, S3 + node cache", base.with_(snapshot_store=s3["s3"]), *trace)
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(report_meta(), rows, single, args)
    return 0 if all(r["failed_or_cut"] == 0 for r in rows) else 1


def report(meta: dict, rows: list[dict], single: dict, args) -> None:
    on = next(r for r in rows if r["config"] == "always-on")
    lines = [
        "# The fleet on a bursty trace",
        "",
        f"{meta['date']}, {meta['machine']}; demo model (135M), {args.bursts} bursts of "
        f"{args.burst_size} streamed completions ({args.tokens} tokens), {args.gap:g} s idle "
        f"between them, downscale delay {args.downscale_delay:g} s, max 2 replicas. "
        "`python -m bench.fleet`.",
        "",
        f"A single process restoring from the same local store ({single['path']}): first token "
        f"{single['ttft_s']:.2f} s after process start.",
        "",
        "| config | requests | failed or cut | TTFT p50 s | TTFT p99 s | first token of a burst s "
        "| replica-s | vs always-on | starts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        starts = ", ".join(f"{k} {v}" for k, v in r["starts"].items())
        lines.append(
            f"| {r['config']} | {r['requests']} | {r['failed_or_cut']} | {r['ttft_p50_s']:.2f} | "
            f"{r['ttft_p99_s']:.2f} | {r['first_token_of_burst_s']:.2f} | "
            f"{r['replica_seconds']:.0f} | {r['replica_seconds'] / on['replica_seconds']:.0%} | "
            f"{starts} |"
        )
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        if r["timeline"]:
            t, n = zip(*r["timeline"], strict=True)
            a.step(t, n, where="post", label=r["config"])
    a.set_xlabel("seconds into the trace")
    a.set_ylabel("replicas (starting + running + stopping)")
    a.legend(fontsize=8)
    names = [r["config"] for r in rows]
    b.bar(names, [r["first_token_of_burst_s"] for r in rows], color="#47a", label="first of burst")
    b.axhline(1.5 * single["ttft_s"], color="r", ls=":", label="1.5x a single restore")
    b.set_ylabel("seconds to first token")
    b.tick_params(axis="x", labelrotation=15)
    b.legend(fontsize=8)
    save_report(
        OUT, "fleet", meta | {"single_restore": single, "args": vars(args)}, rows, lines, fig
    )


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    raise SystemExit(main())
