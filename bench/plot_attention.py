"""Turn bench/attention.py's and bench/sass_check.py's JSON into docs/benchmarks/attention.md
(+ attention.png when GPU figures exist). Never invents numbers: missing parts say pending.

    python -m bench.plot_attention [--dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import OUT as DOCS
from bench.common import committed_in, pyplot, save_figure


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def correctness_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | case | dtype | d | rel. error | LSE abs. error | NaN |", "|" + " --- |" * 7]
    for r in rows:
        lse = "-" if r["lse_err"] is None else f"{r['lse_err']:.1e}"
        out.append(
            f"| {r['kernel']} | {r['case']} | {r['dtype']} | {r['d']} | {r['rel_err']:.1e} "
            f"| {lse} | {r['nan']} |"
        )
    return out


def sass_table(sass: dict) -> list[str]:
    cols = ["MUFU.EX2", "MUFU(all)", "F2I/FRND", "FFMA", "LEA", "HGMMA", "LDS/STS", "total"]
    out = ["| kernel | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, res in sass["kernels"].items():
        if "error" in res:
            out.append(f"| {name} | does not compile |" + " |" * (len(cols) - 1))
        else:
            out.append(f"| {name} | " + " | ".join(str(res[c]) for c in cols) + " |")
    return out


def perf_section(gpu: dict, png: Path) -> list[str]:
    rows = gpu["prefill_tflops"]
    cols = [c for c in rows[0] if c.startswith(("triton", "sdpa"))]
    out = [f"## Prefill TFLOP/s ({gpu['device']}, {gpu['date']}, fp16)", ""]
    out += ["| d | causal | seqlen | " + " | ".join(cols) + " |", "|" + " --- |" * (3 + len(cols))]
    for r in rows:
        vals = " | ".join("-" if r[c] is None else f"{r[c]:.0f}" for c in cols)
        out.append(f"| {r['d']} | {int(r['causal'])} | {r['seqlen']} | {vals} |")
    out += ["", f"![prefill]({png.name})", "", "## Decode (K+V GB/s vs device copy)", ""]
    out += ["| batch | ctx | kernel GB/s | copy GB/s | fraction |", "|" + " --- |" * 5]
    for r in gpu["decode"]:
        out.append(
            f"| {r['batch']} | {r['ctx']} | {r['kernel_GBps']:.0f} | {r['copy_GBps']:.0f} "
            f"| {r['fraction_of_copy']:.2f} |"
        )
    out += ["", "## First-call compile time (s)", "", "```", json.dumps(gpu["compile_s"]), "```"]
    _plot(rows, cols, png)
    return out


def _plot(rows: list[dict], cols: list[str], png: Path) -> None:
    plt = pyplot()
    groups = sorted({(r["d"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
    for ax, (d, causal) in zip(axes[0], groups, strict=True):
        sel = [r for r in rows if r["d"] == d and r["causal"] == causal]
        for c in cols:
            if all(r[c] is not None for r in sel):
                ax.plot([r["seqlen"] for r in sel], [r[c] for r in sel], marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=6)
    save_figure(fig, png)


def runs_line(root: Path, docs: dict[str, dict | None]) -> str:
    """Which run made each part: its tree, or (a run that did not record it) the commit that
    last wrote its JSON."""
    parts = []
    for name, doc in docs.items():
        if doc is None:
            continue
        tree = f"tree {doc['commit']}" if doc.get("commit") else None
        tree = tree or f"committed in {committed_in(root / f'{name}.json') or '?'}"
        parts.append(f"`{name}.json` {tree}")
    return "Runs: " + "; ".join(parts) + "." if parts else "Runs: none yet."


def render(root: Path) -> str:
    cpu = _load(root / "attention_cpu.json")
    sass = _load(root / "attention_sass.json")
    gpu = _load(root / "attention.json")
    docs = {"attention": gpu, "attention_cpu": cpu, "attention_sass": sass}
    lines = ["# Attention kernels (Triton)", "", runs_line(root, docs), ""]
    if gpu is None:
        lines += [
            "**GPU figures pending**: no GPU has been lent to this project yet. "
            "`python -m bench.attention --out $OUT` on the GPU machine measures prefill "
            "TFLOP/s against every SDPA backend, the tau / emulation / LPT columns, decode "
            "GB/s against a device copy, and compile times; then "
            "`python -m bench.plot_attention` fills this page.",
            "",
        ]
    else:
        lines += perf_section(gpu, root / "attention.png") + [""]
    if cpu:
        lines += [
            f"## Correctness in Triton's interpreter ({cpu['date']}, Triton {cpu['triton']})",
            "",
            "`python -m bench.attention --cpu`: relative error ||out - ref|| / ||ref|| against "
            "the float64 reference (bound 2e-3 for fp16), tiny varlen batch with empty and "
            "length-1 sequences, GQA 4.",
            "",
        ]
        lines += correctness_table(cpu["correctness"]) + [""]
    if sass:
        lines += [
            f"## SASS, compiled ahead of time for {sass['arch']} on the CPU (Triton "
            f"{sass['triton']})",
            "",
            "`python bench/sass_check.py`: instruction counts. `exp2_emulated` has no MUFU.EX2 "
            "and no F2I/FRND (FMNMX, 3 FADD, 3 FFMA, 1 LEA per element). The attention "
            "kernels' 2 F2I come from integer divisions by runtime values (program-id decode), "
            "not from the softmax. `fwd_*_emu1/8` emulates 1/8 of the columns via "
            "reshape/split/join of the score tile, which Triton lowers with extra shared-memory "
            "traffic (LDS/STS about doubles): whether it pays on Hopper is for the GPU run; the "
            "tuner only keeps it if it measures faster. `+warp_spec` compiles to the same SASS "
            "on sm_90 with Triton 3.6 (warp specialisation is implemented for Blackwell only).",
            "",
        ]
        lines += sass_table(sass) + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DOCS)
    args = ap.parse_args()
    (args.dir / "attention.md").write_text(render(args.dir))
    print(f"wrote {args.dir / 'attention.md'}")


if __name__ == "__main__":
    main()
