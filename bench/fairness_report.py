"""``bench.fairness``'s page: the probes' p50 / p99 beside each load, the goal, what each load
got, the error messages, the plot."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from bench.common import pyplot, report_meta, save_report
from bench.rawhttp import DEADLINE_S

ENGINES = ("warmboot", "vllm")
COLORS = {"warmboot": "tab:blue", "vllm": "tab:gray"}
SETTLE_S = 30.0
"""At most this long waiting, before a load, for the server to answer quietly again."""
STEP_TOKENS = 16


def outcome_text(row: dict) -> str:
    if "error" in row:
        return row["error"][:200]
    parts = []
    for o in row.get("outcome", []):
        st = ", ".join(f"{k} x{v}" for k, v in o.get("statuses", {}).items())
        extra = ""
        if "answer_s_p50" in o:
            extra = f", in {o['answer_s_p50']:g} s (max {o['answer_s_max']:g})"
        if "opened" in o:
            extra = f", opened {o['opened']}, server closed {o['closed_by_server']}"
            extra += f" (p50 {o['closed_s_p50']:g} s)" if "closed_s_p50" in o else ""
        parts.append(f"{o['label']}: {st or '-'}{extra}")
    if row.get("restarted"):
        parts.append(f"**restarted: {row['restarted']}**")
    if row.get("settle_s", 0) >= SETTLE_S:
        parts.append(f"(still slow from the load before after {SETTLE_S:g} s)")
    return "; ".join(parts) or "-"


def cell(s: dict) -> str:
    fmt = lambda v: "fail" if v is None else f"{v:.0f}"  # noqa: E731
    failed = f" ({s['failed']}/{s['n']} failed)" if s["failed"] else ""
    return f"{fmt(s['p50_ms'])} / {fmt(s['p99_ms'])}{failed}"


def met_text(row: dict | None) -> str:
    if row is None or row.get("met") is None:
        return "-"
    return "yes" if row["met"] else "**no**"


def write_report(args, z, engines, loads, rows) -> None:
    meta = report_meta(
        model=Path(args.model).name, dtype=args.dtype, max_model_len=args.max_model_len
    )
    meta |= {"sizes": dataclasses.asdict(z), "engines": engines, "quick": args.quick}
    if "vllm" in engines:
        from bench.peers import vllm_cpu

        meta["vllm"] = vllm_cpu.VLLM_VERSION
    by = {(r["engine"], r["load"]): r for r in rows}
    lines = report_lines(args, meta, z, engines, loads, by)
    plt = pyplot()
    fig = plot_fairness(plt, engines, ["quiet", *loads], by, meta)
    save_report(args.out, "fairness", meta, {"loads": rows}, lines, fig)


def report_lines(args, meta, z, engines, loads, by) -> list[str]:
    cmd = " ".join(["python -m bench.fairness", *sys.argv[1:]])
    mode = "eager" if args.eager else "each engine at its defaults"
    lines = [
        "# Fairness: a small request's time to first token beside hostile loads",
        "",
        f"{meta['date']} · {meta['machine']} · model `{meta['model']}` ({args.dtype}, {mode},"
        f" max_model_len {args.max_model_len}) · vLLM CPU {meta.get('vllm', '-')} · `{cmd}`.",
        "",
        f"Probes: a streamed 1-token completion and a `GET /health` every {z.interval_s:g} s for"
        f" {z.window_s:g} s, each on a new connection, from 1 s after the load started;"
        " milliseconds, nearest-rank p50 / p99 (a probe with no token counts as infinite:"
        f" `fail`). Goal: p99 <= 2 x the quiet p99 + one decode step (a quiet {STEP_TOKENS}-token"
        " stream's inter-token time), per engine. Load outcome: status (or error) x count,"
        " seconds from the connect to the status line (or to the end without one).",
        "",
    ]
    for e in engines:
        q = by.get((e, "quiet"), {})
        if "ttft" in q:
            lines.append(
                f"- {e}: decode step {q['decode_step_ms']} ms, goal {q['goal_ms']} ms,"
                f" time to a healthy server {q['start_s']} s"
            )
        else:
            lines.append(f"- {e}: {q.get('error', 'not run')}")
    return lines + table_lines(loads, by) + ["", "![fairness](fairness.png)", ""] + reasons(by)


def table_lines(loads, by) -> list[str]:
    lines = [
        "",
        "| load | warmboot TTFT p50 / p99 | goal | met? | warmboot /health p50 / p99 |"
        " vLLM TTFT p50 / p99 | goal | met? | warmboot: load outcome | vLLM: load outcome |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    ok = lambda r: r is not None and "ttft" in r  # noqa: E731
    for load in ["quiet", *loads]:
        w, v = by.get(("warmboot", load)), by.get(("vllm", load))
        gw, gv = (by.get((e, "quiet"), {}).get("goal_ms") for e in ENGINES)
        lines.append(
            f"| {load} | {cell(w['ttft']) if ok(w) else '-'} | {num(gw)} | {met_text(w)} |"
            f" {cell(w['health']) if ok(w) else '-'} | {cell(v['ttft']) if ok(v) else '-'} |"
            f" {num(gv)} | {met_text(v)} | {outcome_text(w) if w else '-'} |"
            f" {outcome_text(v) if v else '-'} |"
        )
    return lines


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def reasons(by) -> list[str]:
    """The error messages the loads got, one line per (engine, load, status)."""
    lines = []
    for (engine, load), row in by.items():
        for o in row.get("outcome", []):
            for status, why in o.get("reasons", {}).items():
                why = why[:200].replace("`", "'")
                lines.append(f"- {engine}, {load}, {o['label']}: {status}: `{why}`")
    return ["Error messages (the first of each status):", "", *lines, ""] if lines else []


def plot_fairness(plt, engines, loads, by, meta):
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(engines))
    for j, e in enumerate(engines):
        xs, ys, hatch = [], [], []
        for i, load in enumerate(loads):
            r = by.get((e, load))
            if r is None or "ttft" not in r:
                continue
            p99 = r["ttft"]["p99_ms"]
            xs.append(i + (j - (len(engines) - 1) / 2) * width)
            ys.append(p99 if p99 is not None else DEADLINE_S * 1e3)
            hatch.append(p99 is None)
        bars = ax.bar(xs, ys, width, color=COLORS[e], label=f"{e} p99")
        for bar, h in zip(bars, hatch, strict=True):
            bar.set_hatch("//" if h else "")
        goal = by.get((e, "quiet"), {}).get("goal_ms")
        if goal:
            ax.axhline(goal, color=COLORS[e], linestyle="--", linewidth=1, label=f"{e} goal")
    ax.set_xticks(range(len(loads)), loads, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p99, ms (log; hatched: failed)")
    ax.set_title(
        f"small request beside hostile loads · {meta['machine']} · {meta['date']}", fontsize=9
    )
    ax.legend(fontsize=8)
    return fig
