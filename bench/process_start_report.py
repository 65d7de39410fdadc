"""``bench.process_start``'s page: the table of starts, the floor of a tier-P restore, the plot;
and the labels of the rows."""

from __future__ import annotations

import collections
import statistics

from bench.common import machine, md_table, pyplot, report_meta, save_figure, write_json, write_page

EAGER = "native cold boot, --enforce-eager"
CHOSEN = tuple(f"chosen by recorded cost, {n} start" for n in ("1st", "2nd", "3rd", "4th", "5th"))
"""``serve`` with a store as a user runs it: after the publishing boot and one tier-P restore
are on record, the 1st start may try a local start once (which restores tier A), the 2nd a
cold start once (only a restore of that key is on record here); from then on the figures
decide, a close call measured again until each path has three (``snapshot.start_costs``)."""
NEW_REPLICA = "chosen by recorded cost, new replica"
"""This host's costs (and spare hints) deleted: only the store's record for this kind of host
decides."""


def write_report(args, results: list[dict], empty: dict, runsc: str, meta=None) -> None:
    meta = meta or report_meta(
        machine=machine(), runsc=runsc, empty_process=empty, repeats=args.repeats
    )
    write_json(args.out / "process_start.json", {"meta": meta, "results": results})
    fixed = empty.get("restore_to_response_s", 0.0)
    chosen = sum(label in CHOSEN for label in results[0]["runs"])
    replica = NEW_REPLICA in results[0]["runs"]
    lines = [
        "# From `warmboot serve` to the first streamed token",
        "",
        f"{meta['date']} · {meta['machine']} · runsc {runsc} (ptrace platform) · bf16 weights "
        "· cold page cache before every start · warmboot's bytecode compiled (as installed) "
        "· first request: 5-token prompt, 4 tokens · "
        "made by `python -m bench.process_start`.",
        "",
        "Every warmboot start has empty compiler caches (a new replica); a restore must "
        "compile nothing (asserted: tier A every step graph an inductor cache hit from the "
        "image's artifacts, tier P no compile phase). Those rows force their path; the next "
        f"{chosen} let `serve` choose by the costs recorded on this machine (the 1st may "
        "try a start outside gVisor once, the 2nd a cold start once; then the medians of "
        "the figures decide, a close call measured again)"
        + (
            "; the new replica's start finds no costs on this host, only those the starts "
            "before it kept in the store's record for this kind of host"
            if replica
            else ""
        )
        + ". Goals: the chosen path never "
        "slower than the eager cold boot; tier P <= 3% of vLLM's default start.",
        "",
        f"Each warmboot row: the median of {_rounds(results)} round(s), all rows of one round "
        "before the next (first token: median [min-max]; the path each round took, counted "
        "where they differ); vLLM's rows ran once.",
        "",
        "| model | start | path reported | healthy s | first token s | vs eager cold boot "
        "| vs vLLM default | compile phases (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for res in results:
        eager = _median(res["runs"][EAGER], "first_token_s")
        vllm = res["runs"].get("vLLM serve (default)")
        vllm_ft = _median(vllm, "first_token_s") if vllm else None
        for label, rows in res["runs"].items():
            ft = _median(rows, "first_token_s")
            vs_vllm = f"{ft / vllm_ft:.1%}" if vllm_ft else "-"
            phases = rows[0].get("phases", {})
            comp = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if "compile" in k) or "-"
            lines.append(
                f"| {res['model']} | {label} | {_paths(rows)} | "
                f"{_median(rows, 'healthy_s'):.2f} | {_spread(rows)} | {ft / eager:.1%} | "
                f"{vs_vllm} | {comp} |"
            )
    lines += [
        "",
        "Floor for a tier-P restore: image + weights read at `dd` speed + runsc's fixed cost.",
        "",
    ]
    head = ["model", "image MB", "weights MB", "dd MB/s", "runsc fixed s", "floor s"]
    cells = []
    for res in results:
        floor = (res["image_bytes"] + res["weights_bytes"]) / res["dd_bytes_per_s"] + fixed
        tp = _median(res["runs"]["tier-P restore"], "first_token_s")
        mb = (f"{res[k] / 1e6:.0f}" for k in ("image_bytes", "weights_bytes", "dd_bytes_per_s"))
        cells.append([res["model"], *mb, f"{fixed:.2f}", f"{floor:.2f}", f"{tp:.2f}"])
        cells[-1].append(f"{tp / floor:.1f}×")
    lines += md_table([*head, "tier P s", "× floor"], "lrrrrrrr", cells)
    lines += ["", "![process start](process_start.png)", ""]
    write_page(args.out / "process_start.md", lines, meta, end="")
    plot(args, results, meta["date"])


def _color(label: str) -> str:
    if label.startswith("vLLM"):
        return "tab:red"
    return "tab:green" if label.endswith("restore") else "tab:gray"


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _rounds(results: list[dict]) -> int:
    return max(len(rows) for res in results for rows in res["runs"].values())


def _spread(rows: list[dict]) -> str:
    """The first token's median, with its range over the rounds where there were several."""
    ft = [r["first_token_s"] for r in rows]
    mid = f"{statistics.median(ft):.2f}"
    return mid if len(ft) == 1 else f"{mid} [{min(ft):.2f}-{max(ft):.2f}]"


def _paths(rows: list[dict]) -> str:
    """The path each round reported, counted where they differ."""
    counts = collections.Counter(r["path"] for r in rows)
    if len(counts) == 1:
        return rows[0]["path"]
    return ", ".join(f"{p} ×{n}" for p, n in counts.most_common())


def plot(args, results: list[dict], date: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        labels = list(res["runs"])
        values = [_median(res["runs"][k], "first_token_s") for k in labels]
        ax.barh(labels, values, color=[_color(k) for k in labels])
        ax.invert_yaxis()
        ax.set_xscale("log")  # NOTE: 2 s restores beside 100-190 s publishing boots
        ax.set_xlabel("seconds from process start to first token (log scale)")
        ax.set_title(res["model"])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.1f}s", va="center")
    fig.suptitle(f"warmboot serve start paths, {date}")
    save_figure(fig, args.out / "process_start.png", dpi=110)
