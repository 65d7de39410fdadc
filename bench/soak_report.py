"""The soak's report (``bench/soak.py``): the summary of its samples, the Markdown, the plot."""

from __future__ import annotations

from bench.common import pyplot


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares MB per minute of ``(seconds, MB)`` points."""
    if len(points) < 2:
        return None
    ts, ys = [t / 60 for t, _ in points], [y for _, y in points]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    cov = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True))
    return round(cov / var, 3) if var else None


def summary(samples: list[dict], marks: dict, counts: dict) -> dict:
    for s in samples:
        s["rest_mb"] = round(s["rss_mb"] - s.get("kv_mb", 0.0), 1)
    after = [s for s in samples if s["t"] >= marks["warm_end_s"]]
    rss = [s["rss_mb"] for s in after] or [0.0]
    at = {"start": 0.0, "after fill": marks["fill_end_s"], "after warm-up": marks["warm_end_s"]}
    points = {k: next((s for s in samples if s["t"] >= t), samples[-1]) for k, t in at.items()}
    keys = ("t", "rss_mb", "kv_mb", "rest_mb", "grammars", "grammar_mb")
    return {
        **marks,
        "points": {
            k: {f: s.get(f) for f in keys} for k, s in (points | {"end": samples[-1]}).items()
        },
        "slope_mb_per_min": slope([(s["t"], s["rss_mb"]) for s in after]),
        "rest_slope_mb_per_min": slope([(s["t"], s["rest_mb"]) for s in after]),
        "range_after_warmup_mb": round(max(rss) - min(rss), 1),
        "last_third_slope_mb_per_min": slope(
            [(s["t"], s["rss_mb"]) for s in after[len(after) * 2 // 3 :]]
        ),
        "requests": {k: dict(c) for k, c in sorted(counts.items())},
        "samples": samples,
    }


def report_lines(meta: dict, res: dict) -> list[str]:
    a = meta["args"]
    rows = [
        f"| {name} | {p['t'] / 60:.1f} | {p['rss_mb']} | {p['kv_mb']} | {p['rest_mb']} | "
        f"{p['grammars'] or 0:g} ({p['grammar_mb'] or 0:g} MB) |"
        for name, p in res["points"].items()
    ]
    reqs = "; ".join(
        f"{k}: " + ", ".join(f"{c} x{n}" for c, n in v.items()) for k, v in res["requests"].items()
    )
    return [
        f"# Soak: warmboot serve, {a['minutes']:g} min of mixed load",
        "",
        f"{meta['machine']}; {meta['date']}; `{meta['command']}`; the server: `{meta['server']}`.",
        "",
        f"Phases: fill (the KV pool written once: distinct {a['max_model_len'] - 8}-token "
        f"prompts, 2 at a time) until {res['fill_end_s'] / 60:.1f} min; warm-up (the mixed "
        f"workload) until {res['warm_end_s'] / 60:.1f} min; then the soak. The mix: {meta['mix']} "
        f"at {a['rate']:g} requests/s, at most {a['max_in_flight']} in flight. Sampled every "
        f"{a['sample_s']:g} s: RSS of the server and its children, the resident part of the "
        "KV pool's mapping, the compiled-grammar cache (`/metrics`).",
        "",
        "| point | min | RSS MB | KV pool resident MB | RSS outside the pool MB | grammars cached |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"After the warm-up: RSS slope **{res['slope_mb_per_min']} MB/min** (outside the KV "
        f"pool: {res['rest_slope_mb_per_min']} MB/min), range {res['range_after_warmup_mb']} MB; "
        f"over its last third {res['last_third_slope_mb_per_min']} MB/min. "
        f"The server {'survived' if res['server_survived'] else '**died**'}.",
        "",
        f"Requests (status: count): {reqs}.",
        "",
        "Why RSS climbs, then is flat: on CPU the KV pool (`warmboot_kv_cache_bytes`) is an "
        "anonymous mapping whose pages become resident as blocks are first written, and the "
        "block manager takes never-used blocks before it evicts cached ones: any load raises "
        "RSS by up to the pool's size, once (the fill does it up front). The other holders "
        "are bounded: the compiled-grammar cache (256 grammars, 64 MiB: "
        "`warmboot_grammar_cache_*`), malloc's arenas (8 per core at most), the Python heap. "
        "Per-request state goes with the request (`tests/test_memory_bounds.py`).",
        "",
        "![soak](soak.png)",
    ]


def plot(meta: dict, res: dict):

    fig, (top, low) = pyplot().subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    s = res["samples"]
    mins = [x["t"] / 60 for x in s]
    top.plot(mins, [x["rss_mb"] for x in s], label="RSS (server + children)")
    top.plot(mins, [x["rest_mb"] for x in s], label="RSS outside the KV pool")
    top.plot(mins, [x.get("kv_mb", 0) for x in s], label="KV pool resident", linestyle="--")
    for ax in (top, low):
        ax.axvspan(0, res["fill_end_s"] / 60, color="tab:orange", alpha=0.12)
        ax.axvspan(res["fill_end_s"] / 60, res["warm_end_s"] / 60, color="gray", alpha=0.12)
    top.set(ylabel="MB", ylim=(0, None))
    top.set_title(
        f"warmboot soak (shaded: fill, warm-up); after the warm-up "
        f"{res['slope_mb_per_min']} MB/min · {meta['machine']} · {meta['date']}",
        fontsize=8,
    )
    top.legend(fontsize=8)
    low.plot(mins, [x.get("grammars", 0) for x in s], color="tab:green", label="grammars cached")
    low.set(ylabel="grammars", xlabel="minutes")
    mb = low.twinx()
    mb.plot(mins, [x.get("grammar_mb", 0) for x in s], color="tab:purple", linestyle=":")
    mb.set_ylabel("cache MB (dotted)", fontsize=8)
    low.legend(fontsize=8, loc="upper left")
    return fig
