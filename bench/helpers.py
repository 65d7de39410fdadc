"""The native kernels' helper thread with the host's core quiet and busy: lent to every step,
lent step by step where it has been faster of late (``device.helper_arms``, the default), and
none. Offline decode of the demo model in bf16, compiled native step, batch 1 / 8 / 32; the
busy host core: a shell busy loop pinned to it (an HTTP front end and clients stand-in).
Modes interleaved per round, the median kept. Writes ``helpers.{json,md,png}`` under --out.

    python -m bench.helpers [--rounds 3] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report
from warmboot.models.demo import ensure_default_model

MODES = {"always": (1, True), "measured": (1, False), "none": (0, False)}
BATCHES, PROMPT, NEW = (1, 8, 32), 128, 48


@contextmanager
def busy_core(cpu: int | None):
    """A busy loop pinned to ``cpu`` while inside (None: nothing)."""
    if cpu is None:
        yield
        return
    loop = subprocess.Popen(["taskset", "-c", str(cpu), "sh", "-c", "while :; do :; done"])
    try:
        yield
    finally:
        loop.kill()
        loop.wait()


def steal() -> tuple[int, int]:
    """(steal, all) jiffies of the machine so far (/proc/stat): time the hypervisor gave away."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return fields[7], sum(fields)


def decode_rate(llm, batch: int) -> float:
    """Output tok/s of decode alone: a NEW-token run less a 1-token one."""
    from warmboot import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 20000) for _ in range(PROMPT)] for _ in range(batch)]
    prompts = [{"prompt_token_ids": p} for p in prompts]

    def run(n: int) -> float:
        llm.engine.block_manager.reset_prefix_cache()  # NOTE: each run prefills its prompts
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    return batch * (NEW - 1) / (run(NEW) - run(1))


def measure(llm, rounds: int, host_cpu: int) -> list[dict]:
    stream, rows = llm.engine.runner.stream, []
    for host in ("quiet", "busy"):
        with busy_core(host_cpu if host == "busy" else None):
            for batch in BATCHES:
                runs = {mode: [] for mode in MODES}
                for _ in range(rounds):
                    for mode, (count, always) in MODES.items():
                        stream.lend_helpers(count, always=always)
                        s0, a0 = steal()
                        run = {"tok_s": decode_rate(llm, batch)}
                        s1, a1 = steal()
                        run["steal"] = (s1 - s0) / max(1, a1 - a0)
                        if stream.arms:  # NOTE: what the measured mode saw: steps, mean ms
                            run["steps_solo_lent"] = stream.arms.steps
                            run["ms_solo_lent"] = stream.arms.means_ms()
                        runs[mode].append(run)
                        print(host, batch, mode, run)
                for mode, r in runs.items():
                    rows.append({"host": host, "batch": batch, "mode": mode, "runs": r})
    stream.lend_helpers(1)
    return rows


def report(rows: list[dict], meta: dict, out: Path) -> None:
    med = {(r["host"], r["batch"], r["mode"]): _median(r["runs"], "tok_s") for r in rows}
    steals = [run["steal"] for r in rows for run in r["runs"]]
    lines = [
        "# The helper thread with the host's core quiet and busy",
        "",
        f"{meta['date']} · {meta['machine']} · {meta['model']}, bf16, compiled native step · "
        f"offline decode tok/s ({PROMPT}-token prompts, {NEW}-token runs less 1-token ones), "
        f"median of {meta['rounds']} rounds, modes interleaved · busy: a shell busy loop "
        f"pinned to the host's core · `python -m bench.helpers` · the hypervisor's steal "
        f"during the runs: median {statistics.median(steals):.0%}, max {max(steals):.0%}",
        "",
        "| host core | batch | always lent | measured (default) | none | measured / best "
        "| measured: steps lent |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lent = {(r["host"], r["batch"]): r["runs"] for r in rows if r["mode"] == "measured"}
    for host in ("quiet", "busy"):
        for b in BATCHES:
            a, m, n = (med[(host, b, mode)] for mode in MODES)
            solo, lent_steps = (
                sum(run["steps_solo_lent"][i] for run in lent[(host, b)]) for i in (0, 1)
            )
            share = lent_steps / max(1, solo + lent_steps)
            ratio = m / max(a, n)
            lines.append(
                f"| {host} | {b} | {a:.1f} | {m:.1f} | {n:.1f} | {ratio:.2f} | {share:.0%} |"
            )
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, host in zip(axes, ("quiet", "busy"), strict=True):
        for i, mode in enumerate(MODES):
            xs = [j + (i - 1) * 0.27 for j in range(len(BATCHES))]
            ax.bar(xs, [med[(host, b, mode)] for b in BATCHES], width=0.27, label=mode)
        ax.set_xticks(range(len(BATCHES)), [f"batch {b}" for b in BATCHES])
        ax.set_title(f"host core {host}")
    axes[0].set_ylabel("decode tok/s")
    axes[0].legend()
    save_report(out, "helpers", meta, rows, lines, fig)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main() -> None:
    from warmboot import LLM
    from warmboot.device.threads import host_cpus

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model = Path(ensure_default_model())
    llm = LLM(str(model), dtype="bfloat16", enforce_eager=False)
    choice = llm.engine.stats()["compile"]["step_choice"]
    if choice["kernel"] != "native" or not llm.engine.runner.stream.lend_helpers(1):
        raise SystemExit(f"no native step with a helper to measure here: {choice}")
    rows = measure(llm, args.rounds, host_cpus(1)[0])
    report(rows, report_meta(model=model.name, rounds=args.rounds), args.out)


if __name__ == "__main__":
    main()
