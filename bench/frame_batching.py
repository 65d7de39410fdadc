"""What the worker's engine thread pays to send one decode step's outputs to the launcher.

A worker writes its outputs as frames on its stdout pipe. One frame per request per step
costs a write and a flush each; one frame per step (what the worker does now) costs one.
Under gVisor (tier P) every write is a system call the sandbox intercepts, so the
difference grows there. A child process (native, then inside ``runsc`` when it can run
here) sends ``STEPS`` steps of ``--batch`` typical delta outputs both ways, alternating,
and reports ms per step of its own time; the parent drains the pipe as the launcher does.
Writes ``docs/benchmarks/frame_batching.{json,md,png}``.

Run from the repository root: ``python -m bench.frame_batching`` (as root for gVisor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, ROOT, pyplot, report_meta, save_report

STEPS = 200
ROUNDS = 5


def item(i: int) -> dict:
    """A typical one-token delta output, as ``output_to_wire`` makes it."""
    return {
        "id": f"remote-{i:032x}",
        "finished": False,
        "num_cached_tokens": 0,
        "c": [
            {
                "index": 0,
                "delta_text": " word",
                "delta_token_ids": [1234],
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
        ],
    }


def child(batch: int) -> None:
    """Send frames on stdout both ways; the last frame carries the timings."""
    from warmboot.launcher.frames import FrameWriter

    writer = FrameWriter(sys.stdout.buffer)
    items = [item(i) for i in range(batch)]
    times: dict[str, list[float]] = {"per_request": [], "per_step": []}
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            for it in items:
                writer.send({"t": "out", **it})
        t1 = time.perf_counter()
        for _ in range(STEPS):
            writer.send({"t": "outs", "items": items})
        t2 = time.perf_counter()
        times["per_request"].append((t1 - t0) / STEPS * 1e3)
        times["per_step"].append((t2 - t1) / STEPS * 1e3)
    writer.send({"t": "result", "ms": {k: statistics.median(v) for k, v in times.items()}})


def drain(proc: subprocess.Popen) -> dict:
    from warmboot.launcher.frames import read_frame

    while (frame := read_frame(proc.stdout)) is not None:
        if frame["t"] == "result":
            proc.wait(timeout=60)
            return frame["ms"]
    raise RuntimeError(f"the child ended without a result (exit {proc.wait()})")


def argv(batch: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", str(batch)]


def run_native(batch: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(argv(batch), stdout=subprocess.PIPE, env=env)
    return drain(proc)


def run_gvisor(batch: int) -> dict | None:
    from warmboot.launcher.sandbox import Sandbox, SandboxSpec, runsc_status

    version, why = runsc_status()
    if version is None:
        print(f"gVisor skipped: {why}", file=sys.stderr)
        return None
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    spec = SandboxSpec(argv=argv(batch), cwd=str(ROOT), env=env)
    with Sandbox(spec, Path(tempfile.mkdtemp(prefix="wb-frames-"))) as box:
        return drain(box.run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    rows = []
    for batch in args.batches:
        row = {"batch": batch, "native": run_native(batch), "gvisor": run_gvisor(batch)}
        print(row, flush=True)
        rows.append(row)
    write_report(args, rows)


def write_report(args, rows: list[dict]) -> None:
    plt = pyplot()
    meta = report_meta(steps=STEPS, rounds=ROUNDS)
    lines = [
        "# Worker output frames: one per request vs one per step",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.frame_batching`: the worker's"
        f" cost (ms of its engine thread per decode step) of sending a step's one-token delta"
        f" outputs on its stdout pipe, {STEPS} steps, median of {ROUNDS} alternating rounds."
        " gVisor: the same child inside `runsc` (ptrace platform), as a tier-P worker runs.",
        "",
        "| batch | where | frame per request ms | frame per step ms | ratio |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        for where in ("native", "gvisor"):
            ms = r[where]
            if ms is None:
                continue
            a, b = ms["per_request"], ms["per_step"]
            lines.append(f"| {r['batch']} | {where} | {a:.3f} | {b:.3f} | {a / b:.1f}x |")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for where in ("native", "gvisor"):
        got = [r for r in rows if r[where] is not None]
        for key, style in (("per_request", "--"), ("per_step", "-")):
            ys = [r[where][key] for r in got]
            xs = [r["batch"] for r in got]
            ax.plot(xs, ys, style, marker="o", label=f"{where}, frame {key.replace('_', ' ')}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in the step")
    ax.set_ylabel("worker ms per step to send outputs")
    ax.set_title(f"worker output frames, {meta['date']}")
    ax.legend(fontsize=8)
    save_report(args.out, "frame_batching", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
