"""Time from ``warmboot serve`` start to the first streamed token, every start path, same run:

- native cold boot (``--sandbox none``, no snapshot store), eager and default,
- tier-A restore (``--sandbox none`` with a store holding the engine image),
- gVisor cold boot (first start with a store: boots in the sandbox, checkpoints, restores
  from the fresh image and publishes; the figure includes all of that),
- tier-P restore (the next start: ``runsc restore`` of the process image),
- ``serve`` with that store five times more, the path chosen by the costs recorded so far
  (``$WARMBOOT_CACHE/start_costs.json`` is cleared first; the rows above force their path),
- then once as a new replica of the same kind of host: this host's costs cleared again, so
  only what the five starts kept in the store's record decides.

warmboot's modules are compiled to bytecode first, as an installed package's are. Each start
runs with a cold page cache (``echo 3 > /proc/sys/vm/drop_caches``; skipped with a
note where that is not allowed). The first request has a 5-token prompt and 4 output tokens,
so the figure measures the start, not the prefill. Also the floor: image + weight bytes over
the ``dd`` read bandwidth measured in the same run, plus ``runsc``'s fixed cost (an empty
process restored). Writes ``docs/benchmarks/process_start.{json,md,png}``.

    python -m bench.process_start [--models demo qwen_1_5b] [--repeats 1] [--keep-work]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve import free_port
from warmboot.launcher.spare_hints import hints_path
from warmboot.snapshot.start_costs import costs_path

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
PROMPT = "serverless replicas start cold"


@functools.cache
def http() -> httpx.Client:
    """One client for the run, made before any start: ``httpx.get`` makes a client, with its
    TLS context (certifi's bundle parsed), on every call: 19 ms of CPU, so polling every 50 ms
    took a quarter of a core from the start being timed (and 19 ms from each first token)."""
    return httpx.Client(timeout=600)


def compile_bytecode() -> None:
    """warmboot's modules compiled to bytecode, as an installed package has them (and as
    vLLM's are): with ``PYTHONDONTWRITEBYTECODE`` set, a checkout compiles every module it
    imports again at every start, and a start that imports more pays more."""
    root = Path(__file__).resolve().parent.parent / "warmboot"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root)], check=True)


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def time_to_first_token(
    model: Path,
    store: Path | None,
    sandbox: str,
    work: Path,
    extra: tuple[str, ...] = (),
    by_cost: bool = False,
) -> dict:
    """Start ``warmboot serve``; seconds to healthy and to the first streamed token, the
    start's phases and how many step graphs it compiled (cache misses). Each start gets empty
    compiler caches (``TORCHINDUCTOR_CACHE_DIR``), as a new replica has. ``by_cost``: the
    start path is chosen by recorded cost (``WARMBOOT_START_BY_COST``), else forced."""
    port = free_port()
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--dtype", "bfloat16", "--sandbox", sandbox, "-v"]
    cmd += ["--served-model-name", "m", "--max-model-len", "512", *extra]
    if store is not None:
        cmd += ["--snapshot-store", str(store)]
    url = f"http://127.0.0.1:{port}"
    log = open(work / f"serve-{port}.log", "w")  # noqa: SIM115
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{port}"))
    env["WARMBOOT_START_BY_COST"] = "1" if by_cost else "0"
    http()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        healthy = _wait_healthy(proc, url, t0)
        first = _first_token(url) - t0
        info = http().get(url + "/health").json()
        phases, compiled = _wait_compiled(url, "--enforce-eager" in extra)
        compiled_s = time.monotonic() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {
        "healthy_s": healthy,
        "first_token_s": first,
        "path": info["start_path"],
        "reason": info.get("start_reason"),
        "phases": phases,
        "compiled_graphs": compiled,
        "compiled_by_s": None if "--enforce-eager" in extra else compiled_s,
    }


def _wait_compiled(url: str, eager: bool) -> tuple[dict[str, float], dict[str, float]]:
    """The start's metrics once its compiled steps run (a restore compiles in the
    background while it serves: polled until its two graphs are in)."""
    deadline = time.monotonic() + 120
    while True:
        text = http().get(url + "/metrics").text
        if eager or "\nwarmboot_compiled_steps 1.0" in text or time.monotonic() > deadline:
            return _start_metrics(text)
        time.sleep(0.1)


def _start_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(phase -> seconds, cache outcome -> graphs) from the server's /metrics."""
    phases, graphs = {}, {}
    for line in text.splitlines():
        for name, out in (
            ("warmboot_startup_phase_seconds", phases),
            ("warmboot_compile_graphs", graphs),
        ):
            if line.startswith(name + "{"):
                label = line.split('"')[1]
                out[label] = float(line.rsplit(" ", 1)[1])
    return phases, graphs


def _wait_healthy(proc: subprocess.Popen, url: str, t0: float) -> float:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"warmboot serve exited with {proc.returncode}")
        try:
            if http().get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 600:
            raise RuntimeError("warmboot serve did not become healthy in 600 s")
        time.sleep(0.05)


def _first_token(url: str) -> float:
    # NOTE: with logprobs a chunk goes out for every token, even one whose text is held back:
    # a random model's tokens may decode to no text (without them, the 1.5B model's first
    # chunk came with its last token, 1.3 s later)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
            "logprobs": 1}  # fmt: skip
    with http().stream("POST", url + "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.monotonic()
    raise RuntimeError("no token streamed")


def dd_bandwidth(path: Path) -> float:
    """Bytes/s of a cold-cache sequential read of ``path``."""
    drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return path.stat().st_size / (time.perf_counter() - t0)


def store_bytes(store: Path, prefix: str) -> int:
    total = 0
    for manifest in (store / "manifests").glob(f"{prefix}*.json"):
        doc = json.loads(manifest.read_text())
        if "files" in doc and prefix:  # process image
            total += sum(c["size"] for f in doc["files"] for c in f["chunks"])
    return total


def tier_a_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file()) - (
        store_bytes(store, "process-")
    )


def check_no_compile(label: str, row: dict) -> None:
    """A restore compiles nothing: tier A loads the image's artifacts (every graph an
    inductor cache hit), tier P restores the compiled process (no compile phase at all)."""
    misses = row["compiled_graphs"].get("miss", 0)
    if label.startswith("tier-A"):
        assert row["path"] == "restored_image" and misses == 0, row
    else:
        assert "compile" not in row["phases"], row
    row["compile_on_restore"] = False


def vllm_rows(model: Path, work: Path) -> dict[str, list[dict]]:
    """``vllm serve`` (its OpenAI server, bf16) to the first token: default (compiled, with a
    cold compile cache as a new replica has) and ``--enforce-eager``."""
    from bench.peers import vllm_cpu

    rows = {}
    for label, eager in (("vLLM serve, --enforce-eager", True), ("vLLM serve (default)", False)):
        drop_caches()
        got = vllm_cpu.serve_first_token(
            model, eager, free_port(), dtype="bfloat16", cold_compile=not eager
        )
        rows[label] = [{"healthy_s": got["healthy_s"], "first_token_s": got["first_token_s"],
                        "path": "vllm", "phases": {}, "compiled_graphs": {}}]  # fmt: skip
        print(f"{label}: {rows[label][0]}", flush=True)
    return rows


EAGER = "native cold boot, --enforce-eager"
CHOSEN = tuple(f"chosen by recorded cost, {n} start" for n in ("1st", "2nd", "3rd", "4th", "5th"))
"""``serve`` with a store as a user runs it: after the publishing boot and one tier-P restore
are on record, the 1st start may try a local start once (which restores tier A), the 2nd a
cold start once (only a restore of that key is on record here); from then on the figures
decide, a close call measured again until each path has three (``snapshot.start_costs``)."""
NEW_REPLICA = "chosen by recorded cost, new replica"
"""This host's costs (and spare hints) deleted: only the store's record for this kind of host
decides."""


def bench_model(name: str, model: Path, work: Path, repeats: int, peers: bool) -> dict:
    runs: dict[str, list[dict]] = {}
    store_a, store_p = work / f"{name}-store-a", work / f"{name}-store-p"
    for r in range(repeats):
        costs_path().unlink(missing_ok=True)  # NOTE: each round records the costs afresh
        for label, store, sandbox, extra in (
            (EAGER, None, "none", ("--enforce-eager",)),
            ("native cold boot", None, "none", ()),
            ("tier-A restore", store_a, "none", ()),
            ("gVisor cold boot (+checkpoint, publish)", store_p, "auto", ()),
            ("tier-P restore", store_p, "auto", ()),
            *((label, store_p, "auto", ()) for label in (*CHOSEN, NEW_REPLICA)),
        ):
            if label == NEW_REPLICA:  # NOTE: its cache is empty
                costs_path().unlink(missing_ok=True)
                hints_path().unlink(missing_ok=True)
            if label == "tier-A restore" and r == 0:
                time_to_first_token(model, store_a, "none", work)  # publish the engine image
            if label.startswith("gVisor") and store_p.exists():
                shutil.rmtree(store_p)
            cold = drop_caches()
            row = time_to_first_token(model, store, sandbox, work, extra, by_cost=store == store_p)
            row["cold_cache"] = cold
            if label.endswith("restore"):
                check_no_compile(label, row)
            runs.setdefault(label, []).append(row)
            print(f"{name}: {label}: {row}", flush=True)
    if peers:
        runs.update(vllm_rows(model, work))
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    return {
        "model": name,
        "weights_bytes": weights,
        "dd_bytes_per_s": dd_bandwidth(next(model.glob("*.safetensors"))),
        "image_bytes": store_bytes(store_p, "process-"),
        "tier_a_bytes": tier_a_bytes(store_p),
        "runs": runs,
    }


def models(names: list[str]) -> dict[str, Path]:
    out = {}
    for name in names:
        if name == "demo":
            from warmboot.models.demo import ensure_default_model

            out[name] = Path(ensure_default_model())
        elif name == "half_b":
            from bench.coldstart import big_model

            out[name] = Path(big_model())
        elif name == "qwen_1_5b":
            from bench.coldstart import qwen_1_5b

            out[name] = Path(qwen_1_5b())
        else:
            out[Path(name).name] = Path(name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["demo", "qwen_1_5b"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM rows out")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--keep-work", action="store_true", help="keep the stores and logs")
    parser.add_argument("--from-json", type=Path, help="rewrite the report from a run's JSON")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        meta = doc["meta"]
        write_report(args, doc["results"], meta["empty_process"], meta["runsc"], meta)
        return
    from warmboot.launcher.probe import measure_empty_process
    from warmboot.launcher.sandbox import runsc_status

    version, why = runsc_status()
    if version is None:
        sys.exit(f"this benchmark needs runsc: {why}")
    compile_bytecode()
    work = Path(tempfile.mkdtemp(prefix="warmboot-pstart-", dir=os.environ.get("TMPDIR")))
    try:
        empty = measure_empty_process(work / "empty")
        results = [
            bench_model(n, p, work, args.repeats, peers=not args.no_vllm and i == 0)
            for i, (n, p) in enumerate(models(args.models).items())
        ]
    finally:
        if args.keep_work:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    write_report(args, results, empty, version)


def write_report(args, results: list[dict], empty: dict, runsc: str, meta=None) -> None:
    from bench.decode import machine

    args.out.mkdir(parents=True, exist_ok=True)
    meta = meta or {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "runsc": runsc,
        "empty_process": empty,
        "repeats": args.repeats,
    }
    doc = {"meta": meta, "results": results}
    (args.out / "process_start.json").write_text(json.dumps(doc, indent=2))
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
    lines += [
        "| model | image MB | weights MB | dd MB/s | runsc fixed s | floor s | tier P s | × floor |"
    ]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for res in results:
        floor = (res["image_bytes"] + res["weights_bytes"]) / res["dd_bytes_per_s"] + fixed
        tp = _median(res["runs"]["tier-P restore"], "first_token_s")
        lines.append(
            f"| {res['model']} | {res['image_bytes'] / 1e6:.0f} | {res['weights_bytes'] / 1e6:.0f} "
            f"| {res['dd_bytes_per_s'] / 1e6:.0f} | {fixed:.2f} | {floor:.2f} | {tp:.2f} | "
            f"{tp / floor:.1f}× |"
        )
    lines += ["", "![process start](process_start.png)", ""]
    (args.out / "process_start.md").write_text("\n".join(lines))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(args.out / "process_start.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
