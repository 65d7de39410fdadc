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
import errno
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.common import pyplot, report_meta, save_report

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
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
    times: dict[str, list[float]] = {"mapped": [], "detached": []}
    restore_tensors(store, manifest, use_mmap=False)  # NOTE: warms the page cache
    for _ in range(reps):
        for mode in times:
            t0 = time.perf_counter()
            out = restore_tensors(store, manifest, use_mmap=mode == "mapped")
            times[mode].append(time.perf_counter() - t0)
            del out
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
        }  # fmt: skip
        for mode, ts in times.items()
    ]


def big_restore_rows(root: Path, reps: int) -> list[dict]:
    """The same on the design page's 0.49B Llama (bf16, built once by bench.coldstart)."""
    from bench.coldstart import big_model

    llm, _ = _boot(big_model(), str(root))
    del llm
    return restore_rows(root, reps, "llama-0.49b")


# -- 2. faults -----------------------------------------------------------------------------------
Fault = Callable[[ExitStack, dict], str]
"""Damages ``ctx`` (a fresh copy of the published store and the S3 objects); returns the
store URL the engine should boot against."""


def _first_chunk(root: Path) -> Path:
    from warmboot.snapshot.ops import load_manifest
    from warmboot.snapshot.store import LocalStore

    store = LocalStore(root)
    manifest = load_manifest(store, store.list_keys()[0])
    big = max(manifest.tensors, key=lambda t: t.nbytes)
    return store.local_chunk_path(big.chunks[0].hash)


def _manifest(root: Path) -> Path:
    return next((root / "manifests").glob("*.json"))


def f_clean(stack, ctx) -> str:
    return str(ctx["local"])


def f_flipped_byte(stack, ctx) -> str:
    chunk = _first_chunk(ctx["local"])
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    return str(ctx["local"])


def f_fifo_chunk(stack, ctx) -> str:
    chunk = _first_chunk(ctx["local"])
    chunk.unlink()
    os.mkfifo(chunk)
    return str(ctx["local"])


def f_linked_chunk_dir(stack, ctx) -> str:
    chunk = _first_chunk(ctx["local"])
    outside = ctx["local"].parent / "outside"
    shutil.move(chunk.parent, outside)
    chunk.parent.symlink_to(outside, target_is_directory=True)
    return str(ctx["local"])


def f_deep_json(stack, ctx) -> str:
    _manifest(ctx["local"]).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    return str(ctx["local"])


def f_huge_manifest(stack, ctx) -> str:
    _manifest(ctx["local"]).write_bytes(b" " * (17 << 20))
    return str(ctx["local"])


def f_missing_tensor(stack, ctx) -> str:
    path = _manifest(ctx["local"])
    doc = json.loads(path.read_text())
    doc["tensors"][0]["name"] = "no.such.weight"
    path.write_text(json.dumps(doc))
    return str(ctx["local"])


def f_local_read_hangs(stack, ctx) -> str:
    from warmboot.snapshot.store import LocalStore

    release, real = threading.Event(), LocalStore.read_chunk
    stack.callback(release.set)
    stack.enter_context(_patched(LocalStore, "read_chunk",
                                 lambda self, h, out: release.wait(120) and real(self, h, out)))  # fmt: skip
    return str(ctx["local"])


def f_full_store_publish(stack, ctx) -> str:
    from warmboot.snapshot.store import LocalStore

    real, calls = LocalStore.put_chunk, []

    def fill(self, h, data):
        calls.append(h)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, h, data)

    stack.enter_context(_patched(LocalStore, "put_chunk", fill))
    return str(ctx["local"].parent / "empty")


def f_tmp_links_outside(stack, ctx) -> str:
    root = ctx["local"].parent / "linked"
    outside = ctx["local"].parent / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"x")
    os.utime(outside / "precious", (1, 1))  # older than the stale-tmp sweep's hour
    root.mkdir()
    (root / "tmp").symlink_to(outside, target_is_directory=True)
    ctx["outside"] = outside
    return str(root)


def f_lease_held(stack, ctx) -> str:
    from warmboot.snapshot.lease import try_lease
    from warmboot.snapshot.store import LocalStore

    root = ctx["local"].parent / "leased"
    lease = try_lease(LocalStore(root), f"publish-{ctx['key']}", ttl_s=600)
    stack.callback(lease.release)
    return str(root)


def f_s3_clean(stack, ctx) -> str:
    return ctx["s3"]


def _stall_s3_on(stack, ctx, method: str) -> None:
    """The proxy stops answering as the S3 store's ``method`` is first called."""
    from warmboot.snapshot.s3_store import S3Store

    proxy, real = ctx["proxy"], getattr(S3Store, method)
    stack.callback(proxy.resume)
    stack.enter_context(_patched(S3Store, method,
                                 lambda self, h, buf: proxy.stall() or real(self, h, buf)))  # fmt: skip


def f_s3_stall_restore(stack, ctx) -> str:
    _stall_s3_on(stack, ctx, "read_chunk")
    return ctx["s3"]


def f_s3_stall_publish(stack, ctx) -> str:
    _stall_s3_on(stack, ctx, "put_chunk")
    return ctx["s3"] + "-empty"


def f_s3_absent(stack, ctx) -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack.enter_context(_env("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}"))
    return ctx["s3"]


FAULTS: dict[str, Fault] = {
    "clean restore (local)": f_clean,
    "flipped byte in a chunk": f_flipped_byte,
    "FIFO for a chunk": f_fifo_chunk,
    "chunk dir links outside": f_linked_chunk_dir,
    "manifest nested 200k deep": f_deep_json,
    "manifest of 17 MB": f_huge_manifest,
    "tensor the model lacks": f_missing_tensor,
    "local read never returns": f_local_read_hangs,
    "store full while publishing": f_full_store_publish,
    "tmp/ links outside while publishing": f_tmp_links_outside,
    "another server holds the publish lease": f_lease_held,
    "clean restore (S3)": f_s3_clean,
    "S3 stops answering mid-restore": f_s3_stall_restore,
    "S3 stops answering mid-publish": f_s3_stall_publish,
    "S3 endpoint not there": f_s3_absent,
}


@contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


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
        rows.append({"fault": name, "path": info.path, "ready_s": ready_s, "same_tokens": same,
                     "store_after": left, "outside_untouched": untouched,
                     "reason": info.reason})  # fmt: skip
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


@contextmanager
def s3_server(golden: Path):
    """moto on 127.0.0.1 behind a stalling proxy, holding a copy of the golden snapshot."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    from tests.store_faults import StallingProxy
    from warmboot.snapshot import s3_store
    from warmboot.snapshot.ops import copy_snapshot
    from warmboot.snapshot.store import LocalStore, open_store

    creds = {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(creds)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="snaps")
    proxy = StallingProxy((host, port))
    os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url
    s3_store.S3_READ_TIMEOUT_S = 2.0  # NOTE: abandoned threads end soon after a stall lifts
    src = LocalStore(golden)
    copy_snapshot(src, open_store("s3://snaps/bench"), src.list_keys()[0])
    try:
        yield {"s3": "s3://snaps/bench", "proxy": proxy}
    finally:
        proxy.close()
        server.stop()


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
        lines.append(f"| {r['model']} | {r['mode']} | {r['gb']:.3f} | {r['median_s']:.3f} | "
                     f"{r['min_s']:.3f} | {r['gb_per_s']:.2f} |")  # fmt: skip
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
        lines.append(f"| {r['fault']} | {r['path']} | {r['ready_s']:.2f} | "
                     f"{'yes' if r['same_tokens'] else '**no**'} | {after} | {reason} |")  # fmt: skip
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 3]})
    short = {"demo-135m": "135M", "llama-0.49b": "0.49B"}
    a.bar([f"{short.get(r['model'], r['model'])}\n{r['mode']}" for r in restore],
          [r["gb_per_s"] for r in restore],
          color=["#888", "#2a7"] * len(restore))  # fmt: skip
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
    rows = [{"kind": "restore", **r} for r in restore] + [{"kind": "fault", **r} for r in faults]
    save_report(OUT, "store_faults", meta | {"cold_s": cold_s}, rows, lines, fig)


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
