"""`warmboot serve` with the engine in the server's process against in its own process
(``--engine-process off|on``), and both against the offline step, in alternated rounds.

Each round: the offline ``LLM`` decode step at batch 1 / 8 / 32 (ms per step), then both
servers (``bench/serve.py``'s streaming load: 32 output tokens per request, greedy) at
concurrency 1 / 8 / 32, in alternating order. Each measurement also records how many cores
other processes took meanwhile (``/proc/stat`` less this process tree), so rounds that a
neighbour disturbed can be told apart on a shared machine. The report takes medians over all
rounds and over the quiet ones (neighbours under 0.2 cores).

Writes ``docs/benchmarks/engine_process.{json,md,png}``.
``python -m bench.engine_process [--rounds 8] [--from-log FILE]`` (a JSON-lines log of an
earlier run, one measurement per line, as this script prints them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import ExitStack
from pathlib import Path

from bench import serve as bs
from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import measured, median_where

SERVERS = ("warmboot-inproc", "warmboot-process")
QUIET = 0.2


def run(rounds: int, concurrency: list[int]) -> list[dict]:
    from warmboot import LLM, SamplingParams
    from warmboot.models.demo import ensure_default_model

    model = str(ensure_default_model())
    llm = LLM(model, dtype="float32")
    llm.engine.wait_compiled()

    def gen(n: int, b: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(bs.prompts(b), params)
        return time.perf_counter() - t

    def offline(b: int) -> float:  # NOTE: the decode step alone: a 1-token run taken off
        return 1e3 * (gen(33, b) - gen(1, b)) / 32

    rows = []
    with ExitStack() as stack:
        servers = [stack.enter_context(s) for s in bs.servers(model, list(SERVERS))]
        for s in servers:
            asyncio.run(bs.load(s, 1, 2, 4))  # NOTE: warm
        for r in range(rounds):
            for c in concurrency:
                ms, foreign = measured(lambda c=c: offline(c))
                rows.append(_row(r, "offline", c, {"step_ms": ms}, foreign))
                for s in servers if r % 2 == 0 else servers[::-1]:
                    n = 4 if c == 1 else 2 * c
                    res, foreign = measured(lambda s=s, c=c, n=n: asyncio.run(bs.load(s, c, n, 32)))
                    keep = {k: res[k] for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")}
                    rows.append(_row(r, s.name, c, keep | {"tok_s": res["out_tok_per_s"]}, foreign))
    return rows


def _row(r: int, server: str, c: int, values: dict, foreign: float) -> dict:
    row = {"round": r, "server": server, "c": c} | {k: round(v, 2) for k, v in values.items()}
    print(json.dumps(row | {"foreign_cores": round(foreign, 2)}), flush=True)
    return row | {"foreign_cores": round(foreign, 2)}


def from_log(path: Path) -> list[dict]:
    """Rows of an earlier run's log (lines that are not measurements are skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "server" in row:
            row.setdefault("c", row.get("b", 1))  # NOTE: offline rows once said "b"
            rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for c in sorted({r["c"] for r in rows}):
        entry = {"c": c}
        for quiet in (False, True):
            pick = [r for r in rows if r["c"] == c and (not quiet or r["foreign_cores"] < QUIET)]
            tag = "quiet_" if quiet else ""
            step = _med(pick, "offline", "step_ms")
            entry[f"{tag}offline_ms"] = step
            for s in SERVERS:
                itl = _med(pick, s, "itl_p50_ms")
                entry[f"{tag}{s}_itl_ms"] = itl
                entry[f"{tag}{s}_tok_s"] = _med(pick, s, "tok_s")
                entry[f"{tag}{s}_itl_vs_offline"] = itl / step if itl and step else None
        out.append(entry)
    return out


def _med(rows: list[dict], server: str, key: str) -> float | None:
    return median_where([r for r in rows if key in r], key, server=server)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    summary = summarise(rows)
    lines = [
        "# The engine in its own process: `warmboot serve` against the offline step",
        "",
        f"{meta['date']} · {meta['machine']} · demo model, float32, 32 output tokens per "
        f"request, greedy · {meta['rounds']} alternated rounds · `python -m bench.engine_process`",
        "",
        "Medians over all rounds (and, in brackets, over the quiet rounds: neighbours under "
        f"{QUIET} cores). ITL: inter-token latency p50; offline: the `LLM` decode step at the "
        "same batch.",
        "",
        "| concurrency | offline ms | in-process ITL ms | engine process ITL ms | "
        "in-process ITL / offline | engine process ITL / offline | in-process tok/s | "
        "engine process tok/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in summary:
        i, p = SERVERS

        def both(key: str, fmt: str, e=e) -> str:
            a, q = e.get(key), e.get(f"quiet_{key}")
            return (fmt.format(a) if a else "-") + (f" [{fmt.format(q)}]" if q else "")

        lines.append(
            f"| {e['c']} | {both('offline_ms', '{:.1f}')} | {both(f'{i}_itl_ms', '{:.1f}')} | "
            f"{both(f'{p}_itl_ms', '{:.1f}')} | {both(f'{i}_itl_vs_offline', '{:.2f}x')} | "
            f"{both(f'{p}_itl_vs_offline', '{:.2f}x')} | {both(f'{i}_tok_s', '{:.1f}')} | "
            f"{both(f'{p}_tok_s', '{:.1f}')} |"
        )
    if meta.get("note"):
        lines += ["", meta["note"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in SERVERS:
        pts = [(e["c"], e[f"{s}_itl_vs_offline"]) for e in summary if e[f"{s}_itl_vs_offline"]]
        ax.plot(*zip(*pts, strict=True), marker="o", label=s)
    ax.axhline(1.1, ls="--", c="gray", label="goal: 1.1x the offline step")
    ax.set(
        xscale="log",
        xlabel="concurrency",
        ylabel="ITL p50 / offline step",
        title="serving against offline",
    )
    ax.legend()
    save_report(out, "engine_process", meta | {"summary": summary}, rows, lines, fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--from-log", type=Path, action="append", help="report an earlier run's log")
    p.add_argument("--note", default="", help="a line for the report (e.g. where a log came from)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.from_log:
        rows = [r for f in args.from_log for r in from_log(f)]
    else:
        rows = run(args.rounds, [int(c) for c in args.concurrency.split(",")])
    served = [r for r in rows if r["server"] == SERVERS[0]]
    rounds = len(served) // max(1, len({r["c"] for r in served}))
    write(args.out, rows, report_meta(rounds=rounds, note=args.note))


if __name__ == "__main__":
    main()
