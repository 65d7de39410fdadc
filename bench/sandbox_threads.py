"""Decode speed on the CPU inside gVisor against natively, by torch intra-op thread count.

A tier-P worker runs inside gVisor, which intercepts every system call, and torch's intra-op
thread pool synchronises its threads with futexes around almost every op. This decodes the
built-in demo model (greedy, 24 new tokens, after a warm-up) in a child process natively and
inside ``runsc``, with 1 thread and with every core, at batch 1 and 16, and reports output
tokens/s. Writes ``docs/benchmarks/sandbox_threads.{json,md,png}``.

Run from the repository root, as root for gVisor: ``python -m bench.sandbox_threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import OUT, ROOT, pyplot, report_meta, save_report

NEW_TOKENS = 24


def child(threads: int, batch: int) -> None:
    from warmboot import LLM, SamplingParams
    from warmboot.models.demo import ensure_default_model

    llm = LLM(
        str(ensure_default_model()),
        max_model_len=256,
        num_kv_blocks=16 * batch + 16,
        cpu_threads=threads,
        pipelined=False,
    )
    prompts = [{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts, params)  # warm
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    print(json.dumps({"tok_s": NEW_TOKENS * batch / (time.perf_counter() - t0)}), flush=True)


def argv(threads: int, batch: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", str(threads), str(batch)]


def env() -> dict[str, str]:
    keep = ("PATH", "LANG", "HOME", "WARMBOOT_CACHE")
    return {k: os.environ[k] for k in keep if k in os.environ} | {"PYTHONPATH": str(ROOT)}


def run_native(threads: int, batch: int) -> float:
    out = subprocess.run(argv(threads, batch), env=env(), capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def run_gvisor(threads: int, batch: int) -> float | None:
    from warmboot.launcher.sandbox import Sandbox, SandboxSpec, runsc_status

    version, why = runsc_status()
    if version is None:
        print(f"gVisor skipped: {why}", file=sys.stderr)
        return None
    spec = SandboxSpec(argv=argv(threads, batch), cwd=str(ROOT), env=env())
    with Sandbox(spec, Path(tempfile.mkdtemp(prefix="wb-threads-"))) as box:
        proc = box.run()
        lines = proc.stdout.read().decode().strip().splitlines()
        proc.wait(timeout=60)
    if not lines:
        raise RuntimeError(f"the sandboxed child printed nothing; see {box.log_path}")
    return json.loads(lines[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child is not None:
        child(*args.child)
        return
    from warmboot.models.demo import ensure_default_model

    ensure_default_model()  # created once, outside the timed children
    cores = os.cpu_count() or 1
    rows = []
    for batch in args.batches:
        for threads in sorted({1, cores}):
            row = {"batch": batch, "threads": threads}
            row |= {"native": run_native(threads, batch), "gvisor": run_gvisor(threads, batch)}
            print(row, flush=True)
            rows.append(row)
    write_report(args, rows)


def write_report(args, rows: list[dict]) -> None:
    plt = pyplot()
    meta = report_meta(model="warmboot-demo-135m, fp32", new_tokens=NEW_TOKENS)
    lines = [
        "# Decode inside gVisor by torch thread count",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.sandbox_threads`: the demo model"
        f" (fp32, sync loop), greedy, {NEW_TOKENS} new tokens after a warm-up, in a child"
        " process natively and inside `runsc` (ptrace platform), one run each.",
        "",
        "| batch | torch threads | native tok/s | gVisor tok/s | gVisor / native |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        gv = r["gvisor"]
        ratio = f"{gv / r['native']:.2f}" if gv else "-"
        gv_text = f"{gv:.1f}" if gv else "-"
        lines.append(f"| {r['batch']} | {r['threads']} | {r['native']:.1f} | {gv_text} | {ratio} |")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"batch {r['batch']}\n{r['threads']} thr" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["native"] for r in rows], 0.4, label="native")
    ax.bar([x + 0.2 for x in xs], [r["gvisor"] or 0 for r in rows], 0.4, label="gVisor")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"decode in gVisor by torch threads, {meta['date']}")
    ax.legend()
    save_report(args.out, "sandbox_threads", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
