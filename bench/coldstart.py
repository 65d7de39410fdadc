"""Cold start: weight-load throughput of peer loaders vs warmboot's tier-A restore, and time
from process start to first token, cold boot vs restore. One run, same files, as ratios.

Models: the built-in demo model (135M, bf16) and the 0.49B Llama of the design page (random
weights, bf16, ``save_pretrained``; cached under the warmboot cache). For each, with a cold page
cache (``sync; echo 3 > /proc/sys/vm/drop_caches``; needs root, skipped with a note otherwise)
and then warm:

* raw ``dd`` read of ``model.safetensors`` (the physical reference),
* safetensors ``load_file``, transformers ``from_pretrained``, tensorizer, Run:ai Model
  Streamer, fastsafetensors (each into CPU memory, every page touched, in a fresh process),
* warmboot ``restore_tensors`` from a local store (every chunk hash-verified),
* time from ``Popen`` to the first generated token: a cold boot vs a tier-A restore.

Writes ``docs/benchmarks/coldstart.{json,md,png}``. ``python -m bench.coldstart``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.checkpoints import big_model
from bench.coldstart_report import ENGINES, LOADERS, gbps, write_report
from bench.common import OUT, ROOT, drop_caches, machine, report_meta
from bench.timing import median_record

ONLY = {"demo": "demo-135m", "big": "llama-0.49b"}
TTFT_SCRIPT = """
import json, sys, time
from warmboot import LLM, SamplingParams
store = sys.argv[2] or None
llm = LLM(sys.argv[1], snapshot_store=store, snapshot_publish=False, **json.loads(sys.argv[3]))
out = llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0))
first = time.time()
info = llm.engine.start_info
print(json.dumps({"first_token": first, "path": info.path, "ready_s": info.ready_s,
                  "phases": info.phase_times, "reason": info.reason}))
"""


def tensorizer_file(model_dir: Path) -> Path:
    path = model_dir.with_name(model_dir.name + ".tensors")
    if not path.is_file():
        from safetensors.torch import load_file
        from tensorizer import TensorSerializer

        ser = TensorSerializer(str(path) + ".tmp")
        ser.write_state_dict(load_file(model_dir / "model.safetensors"))
        ser.close()
        os.replace(str(path) + ".tmp", path)
    return path


# -- workers (each run in a fresh process) --------------------------------------------------------
def touch(tensors) -> int:
    """Read one element per 4 KiB page of every distinct tensor; returns the bytes covered."""
    total, seen = 0, set()
    for t in tensors:
        if t.data_ptr() in seen:  # tied weights appear twice in a state dict
            continue
        seen.add(t.data_ptr())
        flat = t.reshape(-1)
        step = max(1, 4096 // max(1, flat.element_size()))
        if flat.numel():
            flat[::step].float().sum().item()
        total += flat.numel() * flat.element_size()
    return total


def worker(kind: str, model_dir: Path, store: str | None) -> dict:
    import torch

    torch.set_num_threads(2)
    st = model_dir / "model.safetensors"
    load = {
        "load_file": _load_file,
        "from_pretrained": _from_pretrained,
        "tensorizer": _tensorizer,
        "runai": _runai,
        "fastsafetensors": _fastsafetensors,
        "warmboot": _warmboot,
    }[kind]
    prepare, run = load(model_dir, st, store)
    t0 = time.perf_counter()
    nbytes = touch(run(prepare))
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes}


def _load_file(model_dir, st, store):
    from safetensors.torch import load_file

    return st, lambda p: list(load_file(p).values())


def _from_pretrained(model_dir, st, store):
    import torch
    import transformers

    def run(p):
        model = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16)
        return list(model.state_dict().values())

    return model_dir, run


def _tensorizer(model_dir, st, store):
    from tensorizer import TensorDeserializer

    return tensorizer_file(model_dir), lambda p: list(TensorDeserializer(str(p)).values())


def _runai(model_dir, st, store):
    from runai_model_streamer import SafetensorsStreamer

    def run(p):
        with SafetensorsStreamer() as s:
            s.stream_file(str(p))
            # NOTE: yielded tensors live in the streamer's buffer; keep copies, as a loader must
            return [t.clone() for _, t in s.get_tensors()]

    return st, run


def _fastsafetensors(model_dir, st, store):
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    def run(p):
        loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True)
        loader.add_filenames({0: [str(p)]})
        buf = loader.copy_files_to_device()
        tensors = [buf.get_tensor(k).clone() for k in loader.get_keys()]
        buf.close()
        loader.close()
        return tensors

    return st, run


def _warmboot(model_dir, st, store):
    from warmboot.snapshot.ops import load_manifest
    from warmboot.snapshot.restore import restore_tensors
    from warmboot.snapshot.store import open_store

    def run(s):
        (key,) = s.list_keys()
        return list(restore_tensors(s, load_manifest(s, key)).values())

    return open_store(store), run


# -- orchestration --------------------------------------------------------------------------------
def python(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def last_json(proc: subprocess.CompletedProcess, what: str) -> dict:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(kind: str, model: Path, store: str, cold: bool) -> dict | None:
    prepare(cold, lambda: measure(kind, model, store, True))
    proc = python(
        "-m", "bench.coldstart", "--worker", kind, "--model", str(model), "--store", store
    )
    try:
        return last_json(proc, kind)
    except RuntimeError as e:
        print(f"  {kind}: {str(e).splitlines()[-1]}", file=sys.stderr)
        return None


def prepare(cold: bool, warm_up) -> None:
    """Cold: drop the page cache. Warm: run once first. NOTE: this VM runs DAMON reclaim
    (kdamond), which evicts page cache left idle for a while, so 'warm' must be made warm."""
    if cold:
        drop_caches()
    else:
        warm_up()


def dd(path: Path, cold: bool) -> dict:
    prepare(cold, lambda: dd(path, True))
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return {"seconds": time.perf_counter() - t0, "bytes": path.stat().st_size}


def ttft(model: Path, store: str | None, engine: str, cold: bool) -> dict:
    prepare(cold, lambda: ttft(model, store, engine, True))
    t0 = time.time()
    proc = python("-c", TTFT_SCRIPT, str(model), store or "", json.dumps(ENGINES[engine]))
    rec = last_json(proc, "ttft")
    rec["seconds"] = rec["first_token"] - t0
    return rec


def create_snapshot(model: Path, store: str, engine: str) -> None:
    from warmboot.snapshot.store import open_store

    if open_store(store).list_keys():
        return
    script = (
        "import json, sys; from warmboot import LLM; "
        "LLM(sys.argv[1], snapshot_store=sys.argv[2], **json.loads(sys.argv[3]))"
    )
    last = python("-c", script, str(model), store, json.dumps(ENGINES[engine]))
    if last.returncode:
        raise RuntimeError(f"snapshot create failed: {last.stderr[-2000:]}")


def bench_model(name: str, model: Path, stores: dict[str, str], repeats: int) -> dict:
    print(f"== {name}: {model}", flush=True)
    tensorizer_file(model)
    for engine, store in stores.items():
        create_snapshot(model, store, engine)
    store = stores["bf16"]  # the bf16 image holds the checkpoint's bytes: loaders compare 1:1
    st = model / "model.safetensors"
    rows: dict[str, dict] = {}
    for cache in ("cold", "warm"):
        cold = cache == "cold"
        rows[f"dd/{cache}"] = median_record(repeats, dd, st, cold)
        for kind in LOADERS:
            rec = median_record(repeats, measure, kind, model, store, cold)
            if rec:
                rows[f"{kind}/{cache}"] = rec
        for engine, image in stores.items():
            rows[f"ttft_cold_boot_{engine}/{cache}"] = median_record(
                repeats, ttft, model, None, engine, cold
            )
            rows[f"ttft_restore_{engine}/{cache}"] = median_record(
                repeats, ttft, model, image, engine, cold
            )
        for k, v in rows.items():
            if k.endswith(cache):
                print(f"  {k:28s} {v['seconds']:7.3f}s  {gbps(v)}", flush=True)
    return {"model": str(model), "file_bytes": st.stat().st_size, "rows": rows}


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    if "--process" in sys.argv:  # the whole-process comparison lives in its own script
        from bench import process_start

        sys.argv.remove("--process")
        return process_start.main()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", choices=LOADERS)
    p.add_argument("--model", type=Path)
    p.add_argument("--store", default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", choices=("demo", "big"), default=None)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-from", type=Path, default=None, help="re-render a JSON result")
    args = p.parse_args()
    if args.report_from:
        doc = json.loads(args.report_from.read_text())
        write_report(args.out, doc["meta"], doc["results"])
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.store)))
        return
    from warmboot.models.demo import cache_root, ensure_default_model

    can_drop = drop_caches()
    if not can_drop:
        print("NOTE: cannot drop the page cache (not root?): 'cold' rows are warm", file=sys.stderr)
    load_before = load_average()
    models = {"demo-135m": ensure_default_model()}
    if args.only != "demo":
        models["llama-0.49b"] = big_model()
    if args.only:
        models = {k: v for k, v in models.items() if k == ONLY[args.only]}
    results = {}
    for name, model in models.items():
        stores = {e: str(cache_root() / "bench-snapshots" / f"{name}-{e}") for e in ENGINES}
        results[name] = bench_model(name, model, stores, args.repeats)
    meta = run_meta(can_drop, load_before, args.repeats)
    write_report(args.out, meta, results)


def run_meta(can_drop: bool, load_before: str, repeats: int) -> dict:
    import torch

    return report_meta(
        machine=machine(),
        cores=os.cpu_count(),
        torch=torch.__version__,
        page_cache_dropped=can_drop,
        load_average_before_after=f"{load_before} / {load_average()}",
        repeats=repeats,
        engines=ENGINES,
    )


if __name__ == "__main__":
    main()
