"""Host -> device snapshot restore throughput against a pinned-memory copy ceiling (needs CUDA).

Publishes a synthetic image (``--gb`` of bf16 tensors, 64 MiB chunks) to a local store, then
measures, on the same device:

* ceiling: one pinned host buffer copied to the device (``copy_(non_blocking=True)``, events),
* pageable: the same bytes from ordinary host memory,
* warmboot ``restore_tensors(device="cuda")``: read + SHA-256 verify into pinned staging
  buffers, async copies on a copy stream (page cache warm; ``--cold`` also drops it first),

checks the restored tensors bitwise, and writes ``--out`` (JSON) plus a markdown table to stdout.
NOTE: not yet run (no GPU on the development machine). ``python -m bench.gpu_restore``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import git_tree
from warmboot.snapshot.ops import load_manifest
from warmboot.snapshot.publish import publish_image
from warmboot.snapshot.restore import restore_tensors
from warmboot.snapshot.store import LocalStore


def synthetic(gb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """~``gb`` GB of bf16 tensors shaped like transformer weights (big and small)."""
    g = torch.Generator().manual_seed(seed)
    out, total, i = {}, 0, 0
    while total < gb * 1e9:
        rows = 4096 if i % 4 else 16384
        t = torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
        out[f"w{i}"] = t
        total += t.numel() * 2
        i += 1
    return out


def timed_copy(src: torch.Tensor, dst: torch.Tensor, repeats: int = 3) -> float:
    """Best seconds of ``dst.copy_(src)`` over ``repeats`` (CUDA events)."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def ceilings(nbytes: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    return {
        "pinned_gbps": nbytes / timed_copy(pinned, dev) / 1e9,
        "pageable_gbps": nbytes / timed_copy(pageable, dev) / 1e9,
    }


def restore_once(store: LocalStore, key: str, cold: bool) -> tuple[float, dict]:
    if cold:
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)
    manifest = load_manifest(store, key)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = restore_tensors(store, manifest, "cuda")
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--store", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--cold", action="store_true", help="also measure with a dropped page cache")
    p.add_argument("--out", type=Path, default=Path("gpu_restore.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_restore.py needs a CUDA device")
    root = args.store or Path(tempfile.mkdtemp(prefix="warmboot-gpu-restore-"))
    store = LocalStore(root)
    tensors = synthetic(args.gb)
    manifest, _ = publish_image(store, "gpu-bench", {}, tensors.items())
    nbytes = manifest.tensor_bytes
    rows = {"bytes": nbytes} | ceilings(min(nbytes, 1 << 30))
    restore_once(store, "gpu-bench", cold=False)  # fills the page cache, compiles nothing
    seconds, out = restore_once(store, "gpu-bench", cold=False)
    rows["restore_warm_gbps"] = nbytes / seconds / 1e9
    if args.cold:
        seconds, out = restore_once(store, "gpu-bench", cold=True)
        rows["restore_cold_gbps"] = nbytes / seconds / 1e9
    rows["bitwise_equal"] = all(torch.equal(out[n].cpu(), t) for n, t in tensors.items())
    rows["restore_of_pinned"] = rows["restore_warm_gbps"] / rows["pinned_gbps"]
    meta = {
        "date": datetime.date.today().isoformat(),
        **git_tree(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{meta['date']} · {meta['device']} · {nbytes / 1e9:.2f} GB of bf16 tensors")
    print("| path | GB/s |\n| --- | ---: |")
    for k in ("pinned_gbps", "pageable_gbps", "restore_warm_gbps", "restore_cold_gbps"):
        if k in rows:
            print(f"| {k.removesuffix('_gbps')} | {rows[k]:.2f} |")
    print(
        f"restore / pinned ceiling: {rows['restore_of_pinned']:.0%}; bitwise: {rows['bitwise_equal']}"
    )


if __name__ == "__main__":
    main()
