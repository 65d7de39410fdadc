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
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.checkpoints import big_model, qwen_1_5b
from bench.common import OUT, ROOT, drop_caches
from bench.process_start_report import CHOSEN, EAGER, NEW_REPLICA, write_report
from bench.servers import HOST, free_port, serve_cmd, wait_healthy
from warmboot.launcher.spare_hints import hints_path
from warmboot.snapshot.start_costs import costs_path

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
    root = ROOT / "warmboot"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root)], check=True)


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
    cmd = serve_cmd(model, port, "--dtype", "bfloat16", "--sandbox", sandbox, "-v")
    cmd += ["--served-model-name", "m", "--max-model-len", "512", *extra]
    if store is not None:
        cmd += ["--snapshot-store", str(store)]
    url = f"http://{HOST}:{port}"
    log = open(work / f"serve-{port}.log", "w")  # noqa: SIM115
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{port}"))
    env["WARMBOOT_START_BY_COST"] = "1" if by_cost else "0"
    http()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        healthy = wait_healthy(proc, url, t0, interval_s=0.05, client=http(), probe_s=1.0)
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


def _first_token(url: str) -> float:
    # NOTE: with logprobs a chunk goes out for every token, even one whose text is held back:
    # a random model's tokens may decode to no text (without them, the 1.5B model's first
    # chunk came with its last token, 1.3 s later)
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "logprobs": 1,
    }
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
    from bench.peers import vllm_server

    rows = {}
    for label, eager in (("vLLM serve, --enforce-eager", True), ("vLLM serve (default)", False)):
        drop_caches()
        got = vllm_server.serve_first_token(
            model, eager, free_port(), dtype="bfloat16", cold_compile=not eager
        )
        rows[label] = [
            {
                "healthy_s": got["healthy_s"],
                "first_token_s": got["first_token_s"],
                "path": "vllm",
                "phases": {},
                "compiled_graphs": {},
            }
        ]
        print(f"{label}: {rows[label][0]}", flush=True)
    return rows


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
            out[name] = Path(big_model())
        elif name == "qwen_1_5b":
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


if __name__ == "__main__":
    main()
