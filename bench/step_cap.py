"""What ``max_step_ms`` costs and buys: the longest step, a lone long prompt's time to first
token and the prefill throughput of a batch, with no cap and with caps of 100 / 250 / 500 ms
(``serve`` caps at 250 by default; the offline engine has none).

A request arriving mid-step waits for that step (and, in the pipelined loop, the next): the
longest step bounds a newcomer's wait. On a GPU a cap of 100 ms rarely binds; on two CPU cores
it splits prefills into small chunks, each paying the step's fixed cost (the weights streamed
once more, the host work).

Run from the repository root: ``python -m bench.step_cap`` (offline API, demo model, bf16,
eager, one engine at a time). Writes ``docs/benchmarks/step_cap.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report

CAPS = (0.0, 100.0, 250.0, 500.0)


def prompts(count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(length)]}
        for _ in range(count)
    ]


def timed_steps(llm) -> list[float]:
    """Wall seconds of each engine step from now on (the loop's ``step`` wrapped)."""
    loop, times = llm.engine.loop, []
    step = loop.step

    def timed() -> set[str]:
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            times.append(time.perf_counter() - t0)

    loop.step = timed
    return times


def scenario(llm, batch: list[dict], max_tokens: int) -> dict:
    from warmboot import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    steps = timed_steps(llm)
    t0 = time.perf_counter()
    llm.generate(batch, params)
    took = time.perf_counter() - t0
    tokens = sum(len(p["prompt_token_ids"]) for p in batch)
    steps.sort()
    return {
        "seconds": round(took, 2),
        "prompt_tok_s": round(tokens / took, 1),
        "steps": len(steps),
        "step_max_ms": round(1000 * steps[-1], 1),
        "step_p50_ms": round(1000 * steps[len(steps) // 2], 1),
    }


def run_cap(model: str, cap: float, args) -> dict:
    from warmboot import LLM

    with LLM(
        model,
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_step_ms=cap or None,
        cpu_threads=args.cpu_threads,
    ) as llm:
        scenario(llm, prompts(2, 200, seed=0), 2)  # warm-up: the step cost is learnt
        lone = scenario(llm, prompts(1, args.long_prompt, seed=1), 1)
        batch = scenario(llm, prompts(args.batch, args.batch_prompt, seed=2), 1)
    return {"cap_ms": cap, "lone": lone, "batch": batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--long-prompt", type=int, default=1900)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-prompt", type=int, default=256)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from warmboot.models.demo import ensure_default_model

    model = args.model or str(ensure_default_model())
    rows = [run_cap(model, cap, args) for cap in CAPS]
    meta = report_meta(model=Path(model).name, dtype=args.dtype, mode="eager")
    save_report(args.out, "step_cap", meta, rows, report(meta, args, rows), plot(rows, meta))


def report(meta: dict, args, rows: list[dict]) -> list[str]:
    cmd = "python -m bench.step_cap"
    lines = [
        "# What a step time cap costs: `max_step_ms`",
        "",
        f"{meta['date']} · {meta['machine']} · model `{meta['model']}` ({args.dtype}, eager, "
        f"prefix caching off) · offline API · `{cmd}`.",
        "",
        f"Lone: one {args.long_prompt}-token prompt, 1 new token (its time to first token). "
        f"Batch: {args.batch} prompts of {args.batch_prompt} tokens, 1 new token each. Step: "
        "wall time of each engine step (the pipelined loop's `step()`).",
        "",
        "| cap (ms) | lone: seconds | lone: longest step (ms) | batch: prompt tok/s |"
        " batch: vs no cap | batch: step p50 / max (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = rows[0]["batch"]["prompt_tok_s"]
    for r in rows:
        lone, batch = r["lone"], r["batch"]
        lines.append(
            f"| {r['cap_ms'] or 'none'} | {lone['seconds']} | {lone['step_max_ms']} | "
            f"{batch['prompt_tok_s']} | {batch['prompt_tok_s'] / base:.2f}x | "
            f"{batch['step_p50_ms']} / {batch['step_max_ms']} |"
        )
    return [*lines, "", "![step cap](step_cap.png)"]


def plot(rows: list[dict], meta: dict):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [str(int(r["cap_ms"])) if r["cap_ms"] else "none" for r in rows]
    a.bar(labels, [r["batch"]["step_max_ms"] for r in rows], label="longest step")
    a.bar(labels, [r["batch"]["step_p50_ms"] for r in rows], label="median step")
    a.set(xlabel="max_step_ms", ylabel="ms", title="batch prefill: step times")
    a.legend()
    b.bar(labels, [r["batch"]["prompt_tok_s"] for r in rows])
    b.set(xlabel="max_step_ms", ylabel="prompt tokens / s", title="batch prefill throughput")
    fig.suptitle(f"{meta['date']} · {meta['machine']} · {meta['model']}", fontsize=9)
    return fig


if __name__ == "__main__":
    main()
