"""``bench.coldstart``'s page: the loaders' throughput, the first token, the ratios, the plot."""

from __future__ import annotations

from pathlib import Path

from bench.common import md_table, pyplot, save_figure, write_json, write_page

LOADERS = ("load_file", "from_pretrained", "tensorizer", "runai", "fastsafetensors", "warmboot")
ENGINES = {
    "bf16": dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8),
    "fp32": dict(dtype="auto", max_model_len=256, max_num_seqs=8),  # the CPU default: float32
}


def gbps(rec: dict) -> str:
    return f"{rec['bytes'] / rec['seconds'] / 1e9:.2f} GB/s" if "bytes" in rec else ""


def ratios(res: dict, cache: str) -> dict:
    rows = res["rows"]
    dd_rate = rows[f"dd/{cache}"]["bytes"] / rows[f"dd/{cache}"]["seconds"]
    wb = rows.get(f"warmboot/{cache}")
    wb_rate = wb["bytes"] / wb["seconds"] if wb else None
    out = {"restore_of_dd": wb_rate / dd_rate if wb_rate else None}
    peers = {k: rows[f"{k}/{cache}"] for k in LOADERS[:-1] if f"{k}/{cache}" in rows}
    out["restore_vs_peer"] = {
        k: wb_rate / (r["bytes"] / r["seconds"]) if wb_rate else None for k, r in peers.items()
    }
    for engine in ENGINES:
        cold, rest = (
            rows[f"ttft_cold_boot_{engine}/{cache}"],
            rows[f"ttft_restore_{engine}/{cache}"],
        )
        out[f"ttft_restore_of_cold_{engine}"] = rest["seconds"] / cold["seconds"]
    return out


def write_report(out_dir: Path, meta: dict, results: dict) -> None:
    for res in results.values():
        res["ratios"] = {c: ratios(res, c) for c in ("cold", "warm")}
    write_json(out_dir / "coldstart.json", {"meta": meta, "results": results})
    write_page(out_dir / "coldstart.md", render(meta, results), meta)
    plot(out_dir / "coldstart.png", meta, results)
    print(f"wrote {out_dir / 'coldstart.md'}")


NAMES = {
    "dd": "raw `dd` read (reference)",
    "load_file": "safetensors `load_file`",
    "from_pretrained": "transformers `from_pretrained`",
    "tensorizer": "tensorizer",
    "runai": "Run:ai Model Streamer",
    "fastsafetensors": "fastsafetensors (no GDS)",
    "warmboot": "**warmboot restore (verified)**",
}


def _load_cells(rows: dict, kind: str) -> list[str]:
    cells = []
    for cache in ("cold", "warm"):
        r = rows.get(f"{kind}/{cache}")
        cells += [f"{r['seconds']:.3f}", gbps(r).removesuffix(" GB/s")] if r else ["—", "—"]
    return cells


def _ttft_cells(rows: dict) -> list[list[str]]:
    cells = []
    for engine in ENGINES:
        for kind, label in (("ttft_cold_boot", "cold boot"), ("ttft_restore", "tier-A restore")):
            c, w = rows[f"{kind}_{engine}/cold"], rows[f"{kind}_{engine}/warm"]
            ph = w["phases"].get("restore_weights", w["phases"].get("load_weights", 0))
            cells.append([f"{engine}: {label}", f"{c['seconds']:.2f}", f"{w['seconds']:.2f}"])
            cells[-1].append(f"{ph:.3f}")
    return cells


def render(meta: dict, results: dict) -> list[str]:
    lines = [
        "# Cold start: weight loading and time to first token",
        "",
        f"{meta['date']} · {meta['machine']} · {meta['cores']} cores · page cache dropped: "
        f"{'yes' if meta['page_cache_dropped'] else 'NO (cold rows are warm)'} · load average "
        f"before / after: {meta['load_average_before_after']} · median of {meta['repeats']} · "
        f"engines {meta['engines']} · `python -m bench.coldstart`",
        "",
    ]
    for name, res in results.items():
        rows = res["rows"]
        lines += [f"## {name} ({res['file_bytes'] / 1e9:.3f} GB model.safetensors)", ""]
        head = ["load into CPU memory", "cold s", "cold GB/s", "warm s", "warm GB/s"]
        lines += md_table(
            head, "lrrrr", [[label, *_load_cells(rows, kind)] for kind, label in NAMES.items()]
        )
        head = [
            "process start → first token",
            "cold cache s",
            "warm cache s",
            "load phase (warm) s",
        ]
        lines += ["", *md_table(head, "lrrr", _ttft_cells(rows))]
        lines += ["", *md_table(["ratio", "cold cache", "warm cache"], "lrr")]
        rc, rw = res["ratios"]["cold"], res["ratios"]["warm"]
        lines.append(
            f"| restore / dd bandwidth | {pct(rc['restore_of_dd'])} | {pct(rw['restore_of_dd'])} |"
        )
        for peer in rc["restore_vs_peer"]:
            a, b = rc["restore_vs_peer"].get(peer), rw["restore_vs_peer"].get(peer)
            lines.append(f"| restore speed / {NAMES[peer]} | {x(a)} | {x(b)} |")
        for engine in ENGINES:
            key = f"ttft_restore_of_cold_{engine}"
            lines.append(
                f"| first token, {engine}: restore / cold boot | {pct(rc[key])} | {pct(rw[key])} |"
            )
        lines.append("")
        for engine in ENGINES:
            for kind in ("ttft_cold_boot", "ttft_restore"):
                phases = rows[f"{kind}_{engine}/warm"]["phases"]
                lines.append(
                    f"- {engine} {kind.removeprefix('ttft_')} phases (warm cache): "
                    + ", ".join(f"{k} {v:.3f}s" for k, v in phases.items())
                )
        lines.append("")
    return lines + NOTES


NOTES = [
    "## How it is measured",
    "",
    "- Every load runs in a fresh process and ends with one element of every 4 KiB page of every "
    "tensor read. *cold*: `sync; echo 3 > /proc/sys/vm/drop_caches` before the run; *warm*: the "
    "same run repeated right after one unmeasured run (this VM runs DAMON reclaim, `kdamond`, "
    "which evicts idle page cache within minutes, so warm must be made warm).",
    "- safetensors `load_file` returns tensors memory-mapped from the file: warm, it only maps "
    "pages (the touch reads one element of each). warmboot's restore is zero-copy too "
    "(chunk files mapped into place) but hashes every byte with SHA-256 before it returns; with "
    "a warm cache that verification (about 1.6 GB/s per core, on 2 shared cores) is its limit.",
    "- The bf16 snapshot image holds the same bytes as `model.safetensors` (q/k/v and gate/up "
    "fused), so the loader rows compare like for like; the fp32 image (the CPU default dtype) "
    "is twice that.",
    "- First token: wall time from `Popen` to the first generated token of a 4-token prompt, "
    "interpreter start and `import torch` included (about 1.5-2 s here, the same for both paths; "
    "tier A does not remove it, part 2 does). The load phase column is the engine's "
    "`load_weights` (cold boot) or `restore_weights` (restore) phase.",
]


def pct(v: float | None) -> str:
    return f"{v:.0%}" if v is not None else "—"


def x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "—"


def plot(path: Path, meta: dict, results: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 * len(results), figsize=(6 * len(results) + 2, 4))
    for i, (name, res) in enumerate(results.items()):
        ax, ax2 = axes[2 * i], axes[2 * i + 1]
        kinds = [k for k in NAMES if f"{k}/cold" in res["rows"]]
        for j, cache in enumerate(("cold", "warm")):
            vals = [res["rows"][f"{k}/{cache}"] for k in kinds]
            rates = [v["bytes"] / v["seconds"] / 1e9 for v in vals]
            ax.barh([y + 0.4 * j for y in range(len(kinds))], rates, height=0.4, label=cache)
        ax.set_yticks([y + 0.2 for y in range(len(kinds))], [k for k in kinds], fontsize=7)
        ax.set_xlabel("GB/s into CPU memory")
        ax.set_title(f"{name}: load throughput", fontsize=9)
        ax.legend(fontsize=7)
        labels = [f"{e}\n{k}" for e in ENGINES for k in ("cold boot", "restore")]
        for j, cache in enumerate(("cold", "warm")):
            vals = [
                res["rows"][f"ttft_{k}_{e}/{cache}"]["seconds"]
                for e in ENGINES
                for k in ("cold_boot", "restore")
            ]
            ax2.bar(
                [i + 0.4 * j for i in range(len(vals))], vals, width=0.4, label=f"{cache} cache"
            )
        ax2.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
        ax2.set_ylabel("seconds, process start → first token")
        ax2.set_title(f"{name}: time to first token", fontsize=9)
        ax2.legend(fontsize=7)
    fig.text(
        0.01,
        0.01,
        f"{meta['date']} · {meta['machine']} · load {meta['load_average_before_after']}",
        fontsize=6,
    )
    save_figure(fig, path)
