"""Issue 16's server figures, same run: how long ``/health`` and an ordinary 1-token request
take while a body-limit prompt and a slow-to-compile JSON schema are being handled, for this
tree and older revisions (each as a real ``warmboot serve`` process); and what prompt
log-probabilities cost in the prefill (this tree, offline).

Run from the repository root: ``python -m bench.stalls --compare-rev REV``. Writes
``docs/benchmarks/stalls.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import OUT, ROOT, md_table, pyplot, report_meta, revision_trees, save_report
from bench.servers import HOST, free_port, serve_cmd, wait_healthy
from bench.timing import timed

MODEL = "bench"


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def serve(tree: Path, model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = serve_cmd(model, port, "--served-model-name", MODEL, "--sandbox", "none")
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://{HOST}:{port}"
    try:
        wait_healthy(proc, url, timeout_s=120)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"{tree}: the server did not become ready") from None
    return proc, url


def latencies(url: str) -> dict[str, float]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    health = timed(lambda: httpx.get(url + "/health", timeout=120))
    one = timed(lambda: httpx.post(url + "/v1/completions", json=body, timeout=120))
    return {"health": health, "one_token": one}


def under_load(url: str) -> dict[str, float]:
    huge = {"model": MODEL, "prompt": "word " * 700_000, "max_tokens": 1}
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": nested_schema(200)}}
    slow = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "response_format": fmt,
    }
    heavy = [
        threading.Thread(
            target=httpx.post,
            args=(url + "/v1/completions",),
            kwargs={"json": huge, "timeout": 300},
        ),
        threading.Thread(
            target=httpx.post,
            args=(url + "/v1/chat/completions",),
            kwargs={"json": slow, "timeout": 300},
        ),
    ]
    for t in heavy:
        t.start()
    time.sleep(0.3)
    got = latencies(url)
    for t in heavy:
        t.join()
    return got


def measure_tree(tree: Path, model: Path, repeats: int) -> dict:
    proc, url = serve(tree, model)
    try:
        latencies(url)  # warm
        idle = [latencies(url) for _ in range(repeats)]
        busy = [under_load(url) for _ in range(repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        f"{phase}_{k}": med(rows, k)
        for phase, rows in (("idle", idle), ("busy", busy))
        for k in ("health", "one_token")
    }


def prompt_logprobs_cost(model: Path, repeats: int) -> list[dict]:
    """Prefill time of 8 x 512-token prompts, max_tokens=1, with and without prompt logprobs."""
    import torch

    from warmboot import LLM, SamplingParams

    llm = LLM(str(model), max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(1, 4096, (512,), generator=g).tolist()} for _ in range(8)
    ]
    rows = []
    for k in (None, 0, 5):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        llm.generate(prompts[:1], params)
        times = [timed(lambda p=params: llm.generate(prompts, p)) for _ in range(repeats)]
        rows.append({"prompt_logprobs": k, "s": statistics.median(times)})
    base = rows[0]["s"]
    return [r | {"ratio": r["s"] / base} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--compare-rev", nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--replot", type=Path, default=None, help="redraw from a stalls.json")
    args = ap.parse_args()
    if args.replot is not None:
        data = json.loads(args.replot.read_text())
        args.repeats = data["repeats"]
        meta = {k: v for k, v in data.items() if k != "rows"}
        write_report(args, data["rows"]["servers"], data["rows"]["prompt_logprobs"], meta)
        return
    from tests.server_harness import small_llama

    model = small_llama(Path(tempfile.mkdtemp(prefix="wb-stalls-")) / "model")
    with revision_trees(ROOT, args.compare_rev) as trees:
        rows = [
            {"tree": name} | measure_tree(tree, model, args.repeats) for name, tree in trees.items()
        ]
    for r in rows:
        print(r, flush=True)
    cost = prompt_logprobs_cost(model, args.repeats)
    print(cost, flush=True)
    write_report(args, rows, cost)


def write_report(args, rows: list[dict], cost: list[dict], meta: dict | None = None) -> None:
    """The page; ``meta``: a replotted run's (its date, machine and tree), else this run's."""
    plt = pyplot()
    meta = meta or report_meta(repeats=args.repeats)
    lines = [
        "# Stalls and prompt log-probabilities",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.stalls --compare-rev"
        f" {' '.join(args.compare_rev)}`: each tree as a `warmboot serve` process on a small"
        " random Llama (demo tokenizer, 4096 tokens); seconds for `GET /health` and a 1-token"
        " completion, idle and while a 3.5 MB prompt and a JSON schema nested 200 deep are being"
        f" handled; median of {args.repeats}.",
        "",
    ]
    keys = ("idle_health", "idle_one_token", "busy_health", "busy_one_token")
    lines += md_table(
        ["tree", "health idle", "1 token idle", "health under load", "1 token under load"],
        "lrrrr",
        [[r["tree"], *(f"{r[k]:.3f}" for k in keys)] for r in rows],
    )
    lines += [
        "",
        "Prompt log-probabilities in the prefill (this tree, offline, 8 prompts of 512"
        " tokens, max_tokens=1):",
        "",
    ]
    lines += md_table(
        ["prompt_logprobs", "seconds", "vs none"],
        "lrr",
        [[c["prompt_logprobs"], f"{c['s']:.3f}", f"{c['ratio']:.2f}"] for c in cost],
    )
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    keys = ("idle_health", "busy_health", "idle_one_token", "busy_one_token")
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar(
            [j + i * width for j in range(len(keys))], [r[k] for k in keys], width, label=r["tree"]
        )
    ax.set_xticks(
        [j + width * (len(rows) - 1) / 2 for j in range(len(keys))],
        [k.replace("_", " ").replace("busy", "under load") for k in keys],
    )
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title(f"/health and a 1-token request beside heavy ones, {meta['date']}")
    ax.legend()
    save_report(args.out, "stalls", meta, {"servers": rows, "prompt_logprobs": cost}, lines, fig)


if __name__ == "__main__":
    main()
