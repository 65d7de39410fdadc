"""``bench.serve_vllm``'s page: the medians over rounds, the ratios warmboot / vLLM, the plot."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from bench.common import git, machine, pyplot, report_meta, save_report
from bench.peers import vllm_cpu
from bench.timing import median_where

ENGINES = ("warmboot", "vllm")
GOAL = 1.2
"""Goal of the issue: warmboot's output tokens/s at least this many times vLLM's."""
# Numbers kept from the client's result (the median and p50 are the same number; p99 too)
KEEP = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def _med(rows: list[dict], key: str) -> float | None:
    return median_where([r for r in rows if r.get(key) is not None], key)


def summarise(args, rows: list[dict], offline: dict) -> list[dict]:
    """Per concurrency and engine: the median over rounds; then the ratios."""
    out = []
    for c in args.concurrency:
        entry: dict = {"concurrency": c}
        for e in args.engines:
            pick = [r for r in rows if r["engine"] == e and r["concurrency"] == c]
            med = {k: _med(pick, k) for k in (*KEEP, "tokens_per_chunk", "foreign_cores")}
            step = offline.get(e, {}).get(c)
            med["offline_step_ms"] = step
            itl = med["median_itl_ms"]
            med["itl_p50_vs_offline"] = itl / step if itl and step else None
            entry[e] = med
        if all(e in entry for e in ENGINES):
            w, v = entry["warmboot"], entry["vllm"]
            entry["tok_s_ratio"] = _ratio(w["output_throughput"], v["output_throughput"])
            entry["itl_p50_ratio"] = _ratio(w["median_itl_ms"], v["median_itl_ms"])
            entry["tpot_p50_ratio"] = _ratio(w["median_tpot_ms"], v["median_tpot_ms"])
            entry["ttft_p50_ratio"] = _ratio(w["median_ttft_ms"], v["median_ttft_ms"])
        out.append(entry)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def versions() -> dict:
    """The machine and what ran: warmboot's version and tree, vLLM's and its torch's."""
    import warmboot

    code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
    peer = subprocess.run(
        [str(vllm_cpu._python()), "-c", code],
        capture_output=True,
        text=True,
        env=vllm_cpu.peer_env(),
    )
    vllm_v, vllm_torch = (peer.stdout.split() + ["?", "?"])[:2]
    out = {"machine_detail": machine(), "warmboot": warmboot.__version__}
    out["git"] = git("describe", "--always", "--dirty") or ""
    return out | {"vllm": vllm_v, "vllm_torch": vllm_torch}


def write_report(args, rows, starts, summary, offline, raw: Path, versions: dict) -> None:
    cmdline = "python -m bench.serve_vllm " + shlex.join(sys.argv[1:])
    meta = report_meta(
        **versions,
        model=Path(args.model).name,
        input_len=args.input_len,
        output_len=args.output_len,
        rounds=args.rounds,
        num_prompts=args.num_prompts,
        temperature=args.temperature,
        seed=args.seed,
        command=cmdline,
        raw_dir=str(raw),
        offline_step_ms=offline,
        starts=starts,
        summary=summary,
    )
    temp = {0: "greedy", None: "the servers' default sampling"}.get(
        args.temperature, f"temperature {args.temperature}"
    )
    n = f"{args.num_prompts} prompts" if args.num_prompts else "max(8, 4×C) prompts"
    lines = [
        "# Serving: warmboot vs vLLM's CPU build, measured with `vllm bench serve`",
        "",
        f"{meta['date']} · {meta['machine']} · {meta['machine_detail']} · warmboot "
        f"{meta['warmboot']} ({meta['git']}) · vllm-cpu {meta['vllm']} (torch "
        f"{meta['vllm_torch']}) · model `{meta['model']}`, bfloat16, both engines at their "
        f"defaults otherwise · client: `vllm bench serve --backend openai`, random dataset "
        f"{args.input_len} in / {args.output_len} out, EOS ignored, {temp}, {n} per run, "
        f"`--max-concurrency C` · median of {args.rounds} round(s) (engines alternated, one "
        f"server up at a time) · `{cmdline}`",
        "",
        "| C | engine | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | tok/chunk | offline step ms | ITL p50 / offline |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for entry in summary:
        for e in args.engines:
            m = entry[e]
            lines.append(
                f"| {entry['concurrency']} | {e} | {_f(m['request_throughput'], '{:.2f}')} | "
                f"{_f(m['output_throughput'])} | {_f(m['median_ttft_ms'], '{:.0f}')} / "
                f"{_f(m['p99_ttft_ms'], '{:.0f}')} | {_f(m['median_tpot_ms'])} / "
                f"{_f(m['p99_tpot_ms'])} | {_f(m['median_itl_ms'])} / {_f(m['p99_itl_ms'])} | "
                f"{_f(m['tokens_per_chunk'], '{:.2f}')} | {_f(m['offline_step_ms'])} | "
                f"{_f(m['itl_p50_vs_offline'], '{:.2f}×')} |"
            )
    if any("tok_s_ratio" in e for e in summary):
        lines += [
            "",
            f"warmboot / vLLM (goal: output tok/s ≥ {GOAL}×; latencies below 1 are shorter):",
            "",
            "| C | out tok/s | ITL p50 | TPOT p50 | TTFT p50 | goal met |",
            "| ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for e in summary:
            met = "-" if e["tok_s_ratio"] is None else ("yes" if e["tok_s_ratio"] >= GOAL else "no")
            lines.append(
                f"| {e['concurrency']} | {_f(e['tok_s_ratio'], '{:.2f}×')} | "
                f"{_f(e['itl_p50_ratio'], '{:.2f}×')} | {_f(e['tpot_p50_ratio'], '{:.2f}×')} | "
                f"{_f(e['ttft_p50_ratio'], '{:.2f}×')} | {met} |"
            )
    healthy = {e: _med([s for s in starts if s["engine"] == e], "healthy_s") for e in args.engines}
    lines += [
        "",
        "ITL: the client's gap between streamed chunks (tok/chunk: output tokens per chunk; "
        "above 1 an ITL spans several tokens); TPOT: (latency − TTFT) / (tokens − 1). Offline "
        f"step: the engine's offline `LLM` at batch C, ({args.output_len}-token generation − "
        f"1-token one) / {args.output_len - 1}. The client shares the machine with the server. "
        "Time to a healthy `/health` (median): "
        + ", ".join(f"{e} {_f(v)} s" for e, v in healthy.items())
        + ".",
        "",
        "![serving vs vLLM](serve_vllm.png)",
    ]
    save_report(args.out, "serve_vllm", meta, rows, lines, plot(args, summary))


def plot(args, summary: list[dict]):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"warmboot": "tab:blue", "vllm": "tab:orange"}
    cs = [e["concurrency"] for e in summary]
    for name in args.engines:
        col = colors[name]
        tok = [e[name]["output_throughput"] for e in summary]
        itl = [e[name]["median_itl_ms"] for e in summary]
        axes[0].plot(cs, tok, "o-", c=col, label=name)
        axes[1].plot(cs, itl, "o-", c=col, label=f"{name} ITL p50")
        step = [e[name]["offline_step_ms"] for e in summary]
        if any(s is not None for s in step):
            axes[1].plot(cs, step, "x--", c=col, label=f"{name} offline step")
    ratios = [e.get("tok_s_ratio") for e in summary]
    if any(r is not None for r in ratios):
        axes[2].plot(cs, ratios, "o-", c="tab:blue", label="warmboot / vLLM")
        axes[2].axhline(GOAL, ls="--", c="gray", label=f"goal {GOAL}×")
        axes[2].axhline(1.0, ls=":", c="gray")
    titles = ("output tokens/s", "inter-token latency p50 (ms)", "output tok/s, warmboot / vLLM")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    name = Path(args.model).name
    fig.suptitle(
        f"serving, {name} bf16, vllm bench serve {args.input_len} in / {args.output_len} out"
    )
    return fig
