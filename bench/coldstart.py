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
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
ROOT = Path(__file__).resolve().parent.parent
LOADERS = ("load_file", "from_pretrained", "tensorizer", "runai", "fastsafetensors", "warmboot")
BIG_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
BIG_NAME = "bench-llama-0.49b"
QWEN_1_5B_SHAPE = dict(  # Qwen2.5-1.5B's shape (1.54B parameters), random weights
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN_1_5B_NAME = "bench-qwen2-1.5b"
ONLY = {"demo": "demo-135m", "big": "llama-0.49b"}
ENGINES = {
    "bf16": dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8),
    "fp32": dict(dtype="auto", max_model_len=256, max_num_seqs=8),  # the CPU default: float32
}
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


# -- models -------------------------------------------------------------------------------------
def big_model() -> Path:
    """The design page's 0.49B Llama (random, bf16, one model.safetensors), built once."""
    return _built_model(BIG_NAME, "LlamaConfig", "LlamaForCausalLM", BIG_SHAPE)


def qwen_1_5b() -> Path:
    """A model of Qwen2.5-1.5B's shape (random, bf16), built once."""
    return _built_model(QWEN_1_5B_NAME, "Qwen2Config", "Qwen2ForCausalLM", QWEN_1_5B_SHAPE)


def _built_model(name: str, config_cls: str, model_cls: str, shape: dict) -> Path:
    from warmboot.models.demo import cache_root

    path = cache_root() / "models" / name
    if any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file():
        return path
    import torch
    import transformers

    from warmboot.tokenizer.train import train_tokenizer

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = getattr(transformers, config_cls)(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(tmp)
    train_tokenizer(tmp, min(shape["vocab_size"], 32000))
    os.replace(tmp, path)
    return path


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
def drop_caches() -> bool:
    r = subprocess.run(
        "sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, capture_output=True, text=True
    )
    return r.returncode == 0


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
        rows[f"dd/{cache}"] = best(repeats, dd, st, cold)
        for kind in LOADERS:
            rec = best(repeats, measure, kind, model, store, cold)
            if rec:
                rows[f"{kind}/{cache}"] = rec
        for engine, image in stores.items():
            rows[f"ttft_cold_boot_{engine}/{cache}"] = best(
                repeats, ttft, model, None, engine, cold
            )
            rows[f"ttft_restore_{engine}/{cache}"] = best(repeats, ttft, model, image, engine, cold)
        for k, v in rows.items():
            if k.endswith(cache):
                print(f"  {k:28s} {v['seconds']:7.3f}s  {gbps(v)}", flush=True)
    return {"model": str(model), "file_bytes": st.stat().st_size, "rows": rows}


def best(repeats: int, fn, *args) -> dict | None:
    """The median of ``repeats`` runs of ``fn(*args)`` (by seconds)."""
    recs = [r for r in (fn(*args) for _ in range(repeats)) if r]
    return sorted(recs, key=lambda r: r["seconds"])[len(recs) // 2] if recs else None


def gbps(rec: dict) -> str:
    return f"{rec['bytes'] / rec['seconds'] / 1e9:.2f} GB/s" if "bytes" in rec else ""


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

    from bench.decode import machine

    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "page_cache_dropped": can_drop,
        "load_average_before_after": f"{load_before} / {load_average()}",
        "repeats": repeats,
        "engines": ENGINES,
    }


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
    out_dir.mkdir(parents=True, exist_ok=True)
    for res in results.values():
        res["ratios"] = {c: ratios(res, c) for c in ("cold", "warm")}
    (out_dir / "coldstart.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2)
    )
    (out_dir / "coldstart.md").write_text(render(meta, results))
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


def render(meta: dict, results: dict) -> str:
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
        lines += [
            f"## {name} ({res['file_bytes'] / 1e9:.3f} GB model.safetensors)",
            "",
            "| load into CPU memory | cold s | cold GB/s | warm s | warm GB/s |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for kind, label in NAMES.items():
            cells = []
            for cache in ("cold", "warm"):
                r = rows.get(f"{kind}/{cache}")
                cells += [f"{r['seconds']:.3f}", gbps(r).removesuffix(" GB/s")] if r else ["—", "—"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| process start → first token | cold cache s | warm cache s | load phase (warm) s |",
            "| --- | ---: | ---: | ---: |",
        ]
        for engine in ENGINES:
            for kind, label in (
                ("ttft_cold_boot", "cold boot"),
                ("ttft_restore", "tier-A restore"),
            ):
                c, w = rows[f"{kind}_{engine}/cold"], rows[f"{kind}_{engine}/warm"]
                ph = w["phases"].get("restore_weights", w["phases"].get("load_weights", 0))
                lines.append(
                    f"| {engine}: {label} | {c['seconds']:.2f} | {w['seconds']:.2f} | {ph:.3f} |"
                )
        lines += ["", "| ratio | cold cache | warm cache |", "| --- | ---: | ---: |"]
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
    return "\n".join(lines + NOTES) + "\n"


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
