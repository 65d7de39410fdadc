"""Serving under contention: warmboot's and vLLM's OpenAI servers, each alone on the machine
and then with a CPU-bound process beside it, same run, same model, bf16.

Each measurement: 4 concurrent streamed completions (a 24-token prompt, 64 tokens each,
greedy), aggregate output tokens/s, median of the repeats. warmboot runs at its default
thread policy (one compute thread pinned, the other core left to the host loop) and, to show
what the policy buys, with ``--cpu-threads 2`` (the earlier default on 2 cores). The hog is
one Python busy loop per core it is given (``--hogs``). Writes
``docs/benchmarks/contention.{json,md,png}``.

    python -m bench.contention [--repeats 2] [--hogs 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import OUT, pyplot, report_meta, save_report
from bench.servers import HOST, free_port, serve_cmd, wait_healthy

PROMPT = "the replicas of a serverless fleet start cold and then they decode " * 2
CLIENTS, TOKENS = 4, 64


def start_warmboot(model: Path, threads: int | None, work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = serve_cmd(model, port, "--sandbox", "none", "--dtype", "bfloat16")
    cmd += ["--served-model-name", "m", "--max-model-len", "512"]
    cmd += ["--cpu-threads", str(threads)] if threads else []
    log = open(work / f"warmboot-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    wait_healthy(proc, url, interval_s=0.05, probe_s=1.0)
    return proc, url


def throughput(url: str, model: str) -> float:
    """Aggregate output tokens/s of CLIENTS concurrent streamed completions."""
    counts = [0] * CLIENTS
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0}
    body |= {"stream": True, "ignore_eos": True}

    def client(i: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def hog(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (a busy loop each); stopped by the caller."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(url: str, model: str, hogs: int, repeats: int) -> dict:
    throughput(url, model)  # warm-up
    out = {}
    for cond, n in (("alone", 0), ("beside a CPU-bound process", hogs)):
        procs = hog(n)
        try:
            time.sleep(0.5)
            runs = [throughput(url, model) for _ in range(repeats)]
        finally:
            for p in procs:
                p.kill()
        out[cond] = statistics.median(runs)
    return out


def main() -> None:
    from bench.peers import vllm_server
    from warmboot.models.demo import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hogs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model = Path(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="warmboot-contention-"))
    rows = {}
    for label, threads in (("warmboot (default policy)", None), ("warmboot --cpu-threads 2", 2)):
        proc, url = start_warmboot(model, threads, work)
        try:
            rows[label] = measure(url, "m", args.hogs, args.repeats)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(label, rows[label], flush=True)
    port = free_port()
    proc = vllm_server.start_server(model, port, dtype="bfloat16")
    try:
        rows["vLLM (default)"] = measure(f"http://{HOST}:{port}", "peer", args.hogs, args.repeats)
    finally:
        vllm_server.stop_server(proc)
    print("vLLM", rows["vLLM (default)"], flush=True)
    write_report(args, rows)


def write_report(args, rows: dict) -> None:
    meta = report_meta(model="warmboot-demo-135m", dtype="bfloat16", clients=CLIENTS)
    meta |= {"tokens": TOKENS, "hogs": args.hogs, "repeats": args.repeats}
    conds = list(next(iter(rows.values())))
    vllm = rows["vLLM (default)"]
    lines = [
        "# Serving under contention: warmboot vs vLLM's CPU build",
        "",
        f"{meta['date']} · {meta['machine']} · demo model bf16 · {CLIENTS} concurrent streamed "
        f"completions of {TOKENS} tokens · hog: {args.hogs} busy-loop process(es) · median of "
        f"{args.repeats} · `python -m bench.contention`",
        "",
        "| server | "
        + " | ".join(f"{c} tok/s" for c in conds)
        + " | "
        + " | ".join(f"vs vLLM, {c}" for c in conds)
        + " | kept under load |",
        "| --- |" + " ---: |" * (2 * len(conds) + 1),
    ]
    for label, r in rows.items():
        ratios = " | ".join(f"{r[c] / vllm[c]:.2f}x" for c in conds)
        kept = r[conds[-1]] / r[conds[0]]
        lines.append(
            f"| {label} | "
            + " | ".join(f"{r[c]:.1f}" for c in conds)
            + f" | {ratios} | {kept:.0%} |"
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for j, (label, r) in enumerate(rows.items()):
        ax.bar(
            [i + (j - 1) * width for i in range(len(conds))],
            [r[c] for c in conds],
            width,
            label=label,
        )
    ax.set_xticks(range(len(conds)), conds)
    ax.set_ylabel("output tokens/s (4 streams)")
    ax.set_title(f"Serving alone and beside a CPU hog, {meta['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, meta["date"], fontsize=6)
    save_report(
        args.out, "contention", meta, [{"server": k} | v for k, v in rows.items()], lines, fig
    )


if __name__ == "__main__":
    main()
