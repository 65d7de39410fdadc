"""A store nobody trusts: what detaching the restored weights costs, and how long each fault
takes to end in a ready engine. One run, the built-in demo model (135M, bf16), this machine.

1. Restore (tier A, local store, warm page cache): ``restore_tensors`` mapping the chunk
   files (the old default: the tensors *are* the page cache, so a later edit of a chunk
   shows in a running engine and a truncation kills it) against reading them into memory
   the store cannot change (the default now). Interleaved, every chunk hash-verified.
2. Fault matrix: an engine boots against a damaged, hostile or stalled store (local and an
   S3-protocol server, moto, behind a proxy that can stop answering) with
   ``snapshot_timeout=5``; the time to ready, the path and the reason, against a cold boot
   with no store and a clean restore, and whether its greedy tokens match the cold boot's.

Writes ``docs/benchmarks/store_faults.{json,md,png}``. ``python -m bench.store_faults``.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from bench.checkpoints import big_model
from bench.common import OUT, pyplot, report_meta, save_report
from bench.store_fault_cases import FAULTS, s3_server
from bench.timing import interleaved, timed

TIMEOUT_S = 5.0
ENGINE = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, cpu_threads=2)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]


def _tokens(llm) -> list[list[int]]:
    from warmboot import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _boot(model: Path, store: str | None, **kw):
    from warmboot import LLM

    t0 = time.perf_counter()
    llm = LLM(str(model), **ENGINE, snapshot_store=store, snapshot_timeout=TIMEOUT_S, **kw)
    return llm, time.perf_counter() - t0


# -- 1. restore: mapped vs detached -------------------------------------------------------------
def restore_rows(store_root: Path, reps: int, model: str) -> list[dict]:
    from warmboot.snapshot.ops import load_manifest
    from warmboot.snapshot.restore import restore_tensors
    from warmboot.snapshot.store import LocalStore

    store = LocalStore(store_root)
    (key,) = store.list_keys()
    manifest = load_manifest(store, key)
    restore_tensors(store, manifest, use_mmap=False)  # NOTE: warms the page cache

    def once(mapped: bool) -> float:  # NOTE: the tensors go before the next run
        return timed(functools.partial(restore_tensors, store, manifest, use_mmap=mapped))

    runs = {mode: functools.partial(once, mode == "mapped") for mode in ("mapped", "detached")}
    times = interleaved(reps, runs)
    gb = manifest.tensor_bytes / 1e9
    return [
        {
            "model": model,
            "mode": mode,
            "gb": gb,
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "gb_per_s": gb / statistics.median(ts),
            "runs": ts,
        }
        for mode, ts in times.items()
    ]


def big_restore_rows(root: Path, reps: int) -> list[dict]:
    """The same on the design page's 0.49B Llama (bf16, built once: ``bench.checkpoints``)."""
    llm, _ = _boot(big_model(), str(root))
    del llm
    return restore_rows(root, reps, "llama-0.49b")


# -- 2. faults -----------------------------------------------------------------------------------
def fault_rows(model: Path, golden: Path, s3: dict, cold_tokens) -> list[dict]:
    from warmboot.snapshot.store import LocalStore

    rows, key = [], LocalStore(golden).list_keys()[0]
    for name, fault in FAULTS.items():
        with tempfile.TemporaryDirectory(prefix="wb-fault-") as tmp:
            local = Path(tmp) / "store"
            shutil.copytree(golden, local)
            ctx = {"local": local, "key": key, **s3}
            with ExitStack() as stack:  # NOTE: the fault is lifted at its end
                url = fault(stack, ctx)
                before = _tree(ctx["outside"]) if "outside" in ctx else None
                llm, ready_s = _boot(model, url, snapshot_publish="publish" in name)
                info = llm.engine.start_info
                same = _tokens(llm) == cold_tokens
            _wait_abandoned()  # NOTE: an abandoned publish cleans up when its request returns
            left = _left(url) if "publish" in name else ""
            untouched = before is None or _tree(ctx["outside"]) == before
        rows.append(
            {
                "fault": name,
                "path": info.path,
                "ready_s": ready_s,
                "same_tokens": same,
                "store_after": left,
                "outside_untouched": untouched,
                "reason": info.reason,
            }
        )
        print(f"{name:34s} {info.path:15s} {ready_s:6.2f} s  same={same}  {info.reason[:90]}")
        del llm
    return rows


def _wait_abandoned(timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(t.name.startswith("store-") for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _left(url: str) -> str:
    """What a publishing start left in its store: manifests and chunks."""
    from warmboot.snapshot.deadline import run_with_deadline
    from warmboot.snapshot.store import open_store

    store = open_store(url)
    keys, chunks = run_with_deadline(
        "listing", lambda p: (store.list_keys(), store.list_chunks()), 3 * TIMEOUT_S
    )
    return f"{len(keys)} manifests, {len(chunks)} chunks"


def _tree(root: Path) -> dict:
    from tests.store_faults import tree

    return tree(root)


# -- report -----------------------------------------------------------------------------------
def report(meta: dict, restore: list[dict], faults: list[dict], cold_s: float) -> None:
    by = {(r["model"], r["mode"]): r for r in restore}
    ratios = ", ".join(
        f"{m} {by[m, 'detached']['median_s'] / by[m, 'mapped']['median_s']:.2f}x"
        for m in dict.fromkeys(r["model"] for r in restore)
    )
    lines = [
        "# A store nobody trusts: detaching the weights, and each fault's deadline",
        "",
        f"{meta['date']}, {meta['machine']}; local store, warm page cache; the faults on the "
        "demo model (135M, bf16). `python -m bench.store_faults`.",
        "",
        "## Restore: mapped chunk files vs weights copied into process memory",
        "",
        "| model | restore | GB | median s | min s | GB/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in restore:
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['gb']:.3f} | {r['median_s']:.3f} | "
            f"{r['min_s']:.3f} | {r['gb_per_s']:.2f} |"
        )
    lines += [
        "",
        f"Detaching costs {ratios} the mapped restore's time (same run, both verify every "
        "chunk's SHA-256). In exchange a running engine no longer changes when a chunk is "
        "edited in place and no longer dies (SIGBUS) when one is truncated; the mapped path "
        "stays for tier-P workers, whose images then hold no weights (their manifests list "
        "the mapped chunks, so `snapshot rm` keeps them).",
        "",
        f"## Faults: time to a ready engine (snapshot_timeout={TIMEOUT_S:g} s; cold boot "
        f"with no store {cold_s:.2f} s)",
        "",
        "| fault | path | ready s | tokens = cold | store after a publishing start | reason "
        "(restore, or the publish) |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for r in faults:
        text = r["reason"].replace("|", "/")
        found = re.search(r"(publish failed|not published|published)\b.*$", text)
        reason = (found.group(0) if found and "publish" in r["fault"] else text)[:110]
        after = r["store_after"] + ("" if r["outside_untouched"] else "; **wrote outside**")
        lines.append(
            f"| {r['fault']} | {r['path']} | {r['ready_s']:.2f} | "
            f"{'yes' if r['same_tokens'] else '**no**'} | {after} | {reason} |"
        )
    rows = [{"kind": "restore", **r} for r in restore] + [{"kind": "fault", **r} for r in faults]
    fig = _plot(restore, faults, cold_s)
    save_report(OUT, "store_faults", meta | {"cold_s": cold_s}, rows, lines, fig)


def _plot(restore: list[dict], faults: list[dict], cold_s: float):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 3]})
    short = {"demo-135m": "135M", "llama-0.49b": "0.49B"}
    a.bar(
        [f"{short.get(r['model'], r['model'])}\n{r['mode']}" for r in restore],
        [r["gb_per_s"] for r in restore],
        color=["#888", "#2a7"] * len(restore),
    )
    a.set_ylabel("restore GB/s (median, hash-verified)")
    a.set_title("tier-A restore, bf16")
    names = [r["fault"] for r in faults]
    b.barh(names, [r["ready_s"] for r in faults], color="#47a")
    b.axvline(cold_s, color="k", ls="--", label=f"cold boot, no store ({cold_s:.1f} s)")
    b.axvline(cold_s + TIMEOUT_S, color="r", ls=":", label=f"cold + timeout ({TIMEOUT_S:g} s)")
    b.invert_yaxis()
    b.set_xlabel("seconds to a ready engine")
    b.legend(loc="center right")
    b.set_title("each fault ends in a ready engine")
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-big", action="store_true", help="skip the 0.49B restore rows")
    args = p.parse_args()
    from warmboot.models.demo import ensure_default_model
    from warmboot.snapshot import publish as publish_mod

    model = ensure_default_model()
    with tempfile.TemporaryDirectory(prefix="wb-faults-") as tmp:
        golden = Path(tmp) / "golden"
        cold, cold_s = _boot(model, None)
        cold_tokens = _tokens(cold)
        del cold
        publish_mod.CHUNK_BYTES = 16 << 20  # NOTE: several chunks per large tensor
        _boot(model, str(golden))
        restore = restore_rows(golden, args.reps, "demo-135m")
        if not args.no_big:
            restore += big_restore_rows(Path(tmp) / "big", args.reps)
        with s3_server(golden) as s3:
            faults = fault_rows(model, golden, s3, cold_tokens)
    report(report_meta(), restore, faults, cold_s)
    return 0 if all(r["same_tokens"] and r["outside_untouched"] for r in faults) else 1


if __name__ == "__main__":
    raise SystemExit(main())
