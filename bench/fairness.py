"""Issue 23's fairness figures: p50 / p99 time to first token (TTFT) of a stream of small
requests, quiet and beside each hostile load, for warmboot and for vLLM's CPU build on the
same model (the soak, warmboot's memory under a long mixed load, is ``bench/soak.py``).

Each engine runs as its own server process (bf16, same ``max_model_len``) at its defaults
(warmboot probed once its compiled steps serve; ``--eager``: both ``--enforce-eager``, as the
issue's first figures were), one engine at a time. Per load: a load process (so its client
work never holds the probe's GIL) keeps the load's hostile traffic in flight, each request
sent again once answered (a round at most every ``ROUND_S``) and abandoned after
``DEADLINE_S`` (20 s for the schema clients, who leave); one second after it starts, this
process sends a streamed 1-token completion and a ``GET /health`` every ``--interval-s`` for
``--window-s`` (each on a new connection, abandoned after 60 s) and takes nearest-rank p50 /
p99 (a probe that fails or gets no token counts as infinite). Then the load is stopped and
what it got recorded (status codes, seconds to the answer or the refusal, connections the
server closed); a server that died or stopped answering is restarted (recorded). The goal,
per engine: under every load, p99 <= 2 x the quiet p99 plus one decode step (the inter-token
time of a quiet 16-token stream). The loads come from 127.0.0.2, the probes from 127.0.0.1:
two clients, as a hostile client and the others are.

The loads (sizes are flags, ``--quick`` shrinks them): ``schemas`` (N chats, each with a large
distinct ``enum`` json_schema), ``nested`` (one schema of 400 nested objects), ``streams``
(256 concurrent streams), ``echo`` (echo + logprobs + prompt_logprobs + n over a 1000-token
prompt), ``prompts`` (one request with 1000 prompts, one with 256), ``connections`` (a 64 MB
header, 500 silent connections, 600 slowloris connections at 1 byte/s), ``giants`` (a 3.9 MB
chat message, 10^5 messages, 10^4 tools, /v1/responses with 10^5 items, /tokenize of 3.9 MB:
each shrunk to fit the 4 MB body limit), ``deep`` (100k-deep JSON holding a ``\\u`` escape, a
5000-digit integer).

Run from the repository root (a full run: about 15 min for the loads of both engines)::

    python -m bench.fairness [--engines warmboot,vllm] [--loads schemas,streams,...]
                             [--warmboot-args '--max-step-ms 100'] [--quick]

Writes ``docs/benchmarks/fairness.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing as mp
import queue
import shlex
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.common import OUT, ROOT
from bench.fairness_loads import (  # NOTE: the loads' names are kept here for the tests
    BUILDERS,
    LOADS,
    QUICK,
    Sizes,
    load_giants,
    load_main,
    load_schemas,
    raise_fd_limit,
    small_body,
)
from bench.fairness_report import ENGINES, SETTLE_S, STEP_TOKENS, outcome_text, write_report
from bench.rawhttp import DEADLINE_S, exchange, get, post
from bench.servers import HOST, free_port, serve_cmd, stop_group
from bench.timing import nearest_rank as percentile

__all__ = ["BUILDERS", "LOADS", "QUICK", "Sizes", "load_giants", "load_schemas", "main"]
LEAD_IN_S = 1.0
"""From the load's start to the first probe."""


# --- the small requests --------------------------------------------------------------------


def ttft(addr, model: str) -> tuple[float | None, str]:
    """(seconds to the first streamed token or None, the outcome) of one 1-token completion."""
    body = small_body(model)
    ans = exchange(addr, post("/v1/completions", body), body, max_events=1)
    ok = ans.status == 200 and ans.events
    return (ans.events[0] if ok else None), ans.key()


def health(addr) -> tuple[float | None, str]:
    ans = exchange(addr, get("/health"))
    return (ans.head_s if ans.status == 200 else None), ans.key()


def compiled_steps(addr) -> bool:
    """Whether warmboot's compiled model steps serve (its default compiles after the start)."""
    url = f"http://{addr[0]}:{addr[1]}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return b"\nwarmboot_compiled_steps 1.0" in r.read()
    except OSError:
        return False


def decode_step(addr, model: str, repeats: int = 3) -> float | None:
    """Seconds per decode step: the median inter-token time of quiet 16-token streams."""
    body = small_body(model, STEP_TOKENS)
    steps = []
    for _ in range(repeats):
        ans = exchange(addr, post("/v1/completions", body), body)
        if ans.status == 200 and len(ans.events) >= 2:
            steps.append((ans.events[-1] - ans.events[0]) / (STEP_TOKENS - 1))
    return sorted(steps)[len(steps) // 2] if steps else None


def probe_stream(addr, model: str, window_s: float, interval_s: float) -> dict:
    """A 1-token completion and a ``/health`` every ``interval_s`` for ``window_s``, each
    in its own thread; returns their summaries."""
    got: dict[str, list] = {"ttft": [], "health": []}
    threads = []

    def one(kind: str, tick: int, fn) -> None:
        got[kind].append((tick, fn()))

    t0 = time.perf_counter()
    for tick in range(max(1, int(window_s / interval_s))):
        time.sleep(max(0.0, t0 + tick * interval_s - time.perf_counter()))
        for kind, fn in (("ttft", lambda: ttft(addr, model)), ("health", lambda: health(addr))):
            threads.append(threading.Thread(target=one, args=(kind, tick, fn), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join(DEADLINE_S + 5)
    out = {kind: summarize([v for _, v in sorted(got[kind])]) for kind in got}
    return out | {"started_at": round(time.time() - (time.perf_counter() - t0), 3)}


def ms(v: float) -> float | None:
    return None if v is None or math.isinf(v) else round(v * 1e3, 2)


def summarize(samples: list[tuple[float | None, str]]) -> dict:
    """p50 / p99 ms (a failed sample counts as infinite: None), counts of the outcomes."""
    values = [math.inf if v is None else v for v, _ in samples] or [math.inf]
    return {
        "n": len(samples),
        "failed": sum(v is None for v, _ in samples),
        "p50_ms": ms(percentile(values, 50)),
        "p99_ms": ms(percentile(values, 99)),
        "outcomes": dict(Counter(k for _, k in samples)),
        "ms": [ms(v) for v, _ in samples],  # NOTE: in the order sent (failed: None)
    }


# --- the servers ---------------------------------------------------------------------------


class Engine:
    """A server process (own session); ``addr`` and ``model_id`` for requests."""

    name = model_id = ""

    def __init__(self, model: Path, args):
        self.model, self.args = model, args
        self.proc: subprocess.Popen | None = None
        self.addr = (HOST, 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Warmboot(Engine):
    name, model_id = "warmboot", "bench"

    def start(self) -> None:
        self.addr = (HOST, free_port())
        cmd = serve_cmd(self.model, self.addr[1], "--served-model-name", self.model_id)
        cmd += ["--dtype", self.args.dtype, "--max-model-len", str(self.args.max_model_len)]
        eager = ["--enforce-eager"] if self.args.eager else []
        self.cmd = [*cmd, *eager, *shlex.split(self.args.warmboot_args)]
        log = open(f"/tmp/bench-{self.model_id}-warmboot-{self.addr[1]}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + 600
        while health(self.addr)[0] is None:
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"warmboot did not become healthy; see {log.name}")
            time.sleep(0.2)
        while not self.args.eager and not compiled_steps(self.addr):
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"warmboot's compiled steps did not serve; see {log.name}")
            time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever is left of it."""
        stop_group(self.proc, grace_s=30)


class Vllm(Engine):
    name = "vllm"

    def start(self) -> None:
        from bench.peers import vllm_server

        self.model_id = vllm_server._SERVED_NAME
        self.addr = (HOST, free_port())
        kw = {"dtype": self.args.dtype, "max_model_len": self.args.max_model_len}
        self.proc = vllm_server.start_server(
            self.model, self.addr[1], enforce_eager=self.args.eager, timeout_s=900, **kw
        )

    def stop(self) -> None:
        from bench.peers import vllm_server

        vllm_server.stop_server(self.proc)


def answering(engine: Engine, limit_s: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and engine.alive():
        if ttft(engine.addr, engine.model_id)[0] is not None:
            return True
        time.sleep(1.0)
    return False


def recover(engine: Engine) -> str | None:
    """Restart the server if it died or does not answer a small request within 60 s;
    returns why it was restarted, or None."""
    if answering(engine):
        return None
    why = "stopped answering" if engine.alive() else f"died (rc {engine.proc.returncode})"
    engine.stop()
    engine.start()
    return why


def settle(engine: Engine, bound_s: float) -> float:
    """Seconds until a small request's TTFT is back under ``bound_s`` (at most SETTLE_S)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        got = ttft(engine.addr, engine.model_id)[0]
        if got is not None and got <= bound_s:
            break
        time.sleep(0.5)
    return round(time.monotonic() - t0, 2)


# --- a run per engine ----------------------------------------------------------------------


def quiet_run(engine: Engine, z: Sizes) -> dict:
    for _ in range(3):  # NOTE: warm-up (first-request allocations)
        ttft(engine.addr, engine.model_id)
    step = decode_step(engine.addr, engine.model_id)
    probes = probe_stream(engine.addr, engine.model_id, z.window_s, z.interval_s)
    row = {"engine": engine.name, "load": "quiet", "decode_step_ms": ms(step)} | probes
    p99 = probes["ttft"]["p99_ms"]
    row["goal_ms"] = None if p99 is None or step is None else round(2 * p99 + step * 1e3, 2)
    return row


def load_run(engine: Engine, name: str, z: Sizes, goal_ms: float | None) -> dict:
    settled = settle(engine, (goal_ms or 1e3) / 1e3)
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    args = (name, engine.addr, engine.model_id, z, ready, stop, out)
    child = ctx.Process(target=load_main, args=args, daemon=True)
    t0 = time.monotonic()
    child.start()
    while not ready.wait(0.5) and child.is_alive() and time.monotonic() - t0 < 120:
        pass  # NOTE: building the bodies (a 64 MB header, 4 MB giants) takes a moment
    time.sleep(LEAD_IN_S)
    probes = probe_stream(engine.addr, engine.model_id, z.window_s, z.interval_s)
    stop.set()
    outcome = collect(child, out)
    row = {"engine": engine.name, "load": name, "settle_s": settled} | probes
    row |= {"outcome": outcome, "load_s": round(time.monotonic() - t0, 1)}
    row["restarted"] = recover(engine)
    p99 = probes["ttft"]["p99_ms"]
    row["goal_ms"] = goal_ms
    row["met"] = None if goal_ms is None else (p99 is not None and p99 <= goal_ms)
    return row


def collect(child, out) -> list[dict]:
    try:
        got = out.get(timeout=DEADLINE_S + 30)
    except queue.Empty:
        child.kill()
        got = [{"label": "load process", "statuses": {f"stuck past {DEADLINE_S + 30:g} s": 1}}]
    child.join(10)
    if child.is_alive():
        child.kill()
    return got


def run_engine(engine: Engine, z: Sizes, loads: list[str]) -> list[dict]:
    t0 = time.monotonic()
    try:
        engine.start()
    except Exception as e:  # noqa: BLE001
        print(f"{engine.name}: did not start: {e}", flush=True)
        return [{"engine": engine.name, "load": "quiet", "error": f"did not start: {e}"[:2000]}]
    try:
        quiet = quiet_run(engine, z)
        quiet["start_s"] = round(time.monotonic() - t0, 1)
        report_row(quiet)
        rows = [quiet]
        for name in loads:
            try:
                rows.append(load_run(engine, name, z, quiet["goal_ms"]))
            except Exception as e:  # noqa: BLE001 (a restart that failed)
                rows.append({"engine": engine.name, "load": name, "error": repr(e)[:2000]})
            report_row(rows[-1])
            if not engine.alive():
                break
    finally:
        engine.stop()
    return rows


def report_row(row: dict) -> None:
    if "ttft" not in row:
        print(f"{row['engine']:>8} {row['load']:<12} {outcome_text(row)}", flush=True)
        return
    t, h = row["ttft"], row["health"]
    print(
        f"{row['engine']:>8} {row['load']:<12} ttft p50/p99 {t['p50_ms']}/{t['p99_ms']} ms"
        f" (failed {t['failed']}/{t['n']}), health p99 {h['p99_ms']} ms,"
        f" met {row.get('met', '-')}, {outcome_text(row)}",
        flush=True,
    )


def sizes_from(args) -> Sizes:
    """The flags given, else the ``--quick`` sizes, else the defaults."""
    z = Sizes(**(QUICK if args.quick else {}))
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)}
    return dataclasses.replace(z, **{k: v for k, v in given.items() if v is not None})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", default="warmboot,vllm", help="comma-separated: warmboot,vllm")
    ap.add_argument(
        "--loads", default=",".join(LOADS), help="comma-separated subset of " + ",".join(LOADS)
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes and windows: a smoke run")
    ap.add_argument("--model", type=Path, default=None, help="default: the demo model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="both engines --enforce-eager")
    ap.add_argument(
        "--warmboot-args", default="", help="more `warmboot serve` flags, e.g. '--max-step-ms 0'"
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=OUT)
    for f in dataclasses.fields(Sizes):
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=None,
            help=f"default {f.default} ({QUICK.get(f.name, f.default)} with --quick)",
        )
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    loads = [n for n in args.loads.split(",") if n]
    bad = sorted(set(engines) - set(ENGINES)) + sorted(set(loads) - set(LOADS))
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    z = sizes_from(args)
    if args.model is None:
        from warmboot.models.demo import ensure_default_model

        args.model = Path(ensure_default_model())
    raise_fd_limit()
    made = {"warmboot": Warmboot, "vllm": Vllm}
    rows = [r for e in engines for r in run_engine(made[e](args.model, args), z, loads)]
    write_report(args, z, engines, loads, rows)


if __name__ == "__main__":
    main()
