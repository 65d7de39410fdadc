"""``warmboot snapshot create|ls|inspect|verify|rm|push|pull``.

Registering the parser imports nothing heavy (no torch), so ``warmboot --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from warmboot.engine_options import add_engine_options, engine_kwargs

CREATE_OWN = ("snapshot_store", "snapshot_publish")
"""Engine settings ``snapshot create`` spells its own way (``--store``) or fixes (it publishes)."""


def add_snapshot_parser(sub) -> None:
    """Register ``snapshot`` and its subcommands on the top-level subparsers."""
    snap = sub.add_parser("snapshot", help="create, list, inspect, verify, copy tier-A snapshots")
    cmds = snap.add_subparsers(dest="snapshot_command", required=True)
    store_help = "a directory or s3://bucket/prefix (default $WARMBOOT_CACHE/snapshots)"

    def command(name: str, help: str, fn: Callable) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help)
        p.add_argument("--store", default=None, help=store_help)
        p.add_argument("-v", "--verbose", action="store_true", help="log start-up phases")
        p.set_defaults(snapshot_func=fn)
        return p

    create = command("create", "boot the model and publish a snapshot for its key", _create)
    create.add_argument("--model", required=True, help="directory of a Hugging Face-format model")
    # NOTE: the store is --store; create always publishes
    add_engine_options(create, leave_out=CREATE_OWN, verbose=False)
    command("ls", "list the snapshots in a store", _ls)
    inspect = command("inspect", "show every key field, fact, tensor and file", _inspect)
    inspect.add_argument("key", help="a snapshot key or a unique prefix")
    inspect.add_argument("--json", action="store_true", help="print the manifest")
    verify = command("verify", "read and hash every chunk", _verify)
    verify.add_argument("key", nargs="?", default=None, help="key or prefix (default: all)")
    rm = command("rm", "remove a snapshot and the chunks nothing else uses", _rm)
    rm.add_argument("key")
    push = command("push", "copy snapshots from --store to --to (missing chunks only)", _push)
    push.add_argument("key", nargs="?", default=None, help="key or prefix (default: all)")
    push.add_argument("--to", required=True, help="destination store")
    pull = command("pull", "copy snapshots from --from into --store (missing chunks only)", _pull)
    pull.add_argument("key", nargs="?", default=None, help="key or prefix (default: all)")
    pull.add_argument("--from", dest="source", required=True, help="source store")
    snap.set_defaults(snapshot_func=None)


def run_snapshot(args) -> int:
    from warmboot.snapshot.image import SnapshotError

    try:
        return args.snapshot_func(args)
    except (SnapshotError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _open(url: str | None):
    from warmboot.snapshot.store import open_store

    return open_store(url)


@contextmanager
def _progress(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar (tqdm: bytes done and GB/s) on stderr."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000) as bar:
        yield bar.update


def _create(args) -> int:
    from warmboot import LLM

    t0 = time.perf_counter()
    store = str(_open(args.store).url)
    llm = LLM(**engine_kwargs(args, args.model, CREATE_OWN), snapshot_store=store)
    info, snap = llm.engine.start_info, llm.engine.snapshot
    if info.path == "restored_image":
        print(f"snapshot {snap.key} already in {store} (restored it in {info.ready_s:.2f}s)")
        return 0
    if load_manifest_or_none(snap.store, snap.key) is None:
        print(f"error: publishing {snap.key} to {store} failed (see the log)", file=sys.stderr)
        return 1
    print(f"created snapshot {snap.key} in {store} ({time.perf_counter() - t0:.1f}s)")
    return 0


def load_manifest_or_none(store, key: str):
    from warmboot.snapshot.image import SnapshotError
    from warmboot.snapshot.ops import load_manifest

    try:
        return load_manifest(store, key)
    except SnapshotError:
        return None


def _ls(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from warmboot.snapshot import process_image
    from warmboot.snapshot.image import SnapshotError
    from warmboot.snapshot.ops import load_manifest

    store = _open(args.store)
    table = Table(title=f"snapshots in {store.url}")
    for col in ("key", "created", "model", "dtype", "device", "tensors", "GB"):
        table.add_column(col)
    for key in store.list_keys():
        if process_image.is_process_key(key):
            table.add_row(*_process_row(store, key))
            continue
        try:
            m = load_manifest(store, key)
        except SnapshotError as e:
            table.add_row(key, "?", f"unreadable: {e}", "", "", "", "")
            continue
        table.add_row(
            key,
            m.created,
            str(m.extra.get("model_dir", "?")),
            m.fields.get("engine.dtype", "?"),
            m.fields.get("device.type", "?"),
            str(len(m.tensors)),
            f"{m.tensor_bytes / 1e9:.3f}",
        )
    Console().print(table)
    print(f"{len(store.list_chunks())} chunks, {store.stored_bytes() / 1e9:.3f} GB stored")
    return 0


def _process_row(store, key: str) -> list[str]:
    """An ``ls`` row for a process image (tier P) in the same store."""
    from warmboot.snapshot import process_image

    try:
        m = process_image.parse(store.get_manifest(key) or b"")
    except process_image.ProcessImageError as e:
        return [key, "?", f"unreadable: {e}", "", "", "", ""]
    size = sum(process_image.chunk_refs(m).values())
    created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(m["created"]))
    return [key, created, "process image (gVisor)", "", "", "", f"{size / 1e9:.3f}"]


def _inspect(args) -> int:
    from warmboot.snapshot import process_image
    from warmboot.snapshot.ops import load_manifest, resolve_keys

    store = _open(args.store)
    (key,) = resolve_keys(store, args.key)
    if process_image.is_process_key(key):
        print(json.dumps(process_image.parse(store.get_manifest(key) or b""), indent=1))
        return 0
    m = load_manifest(store, key)
    if args.json:
        print(m.to_json().decode())
        return 0
    print(f"snapshot {m.key} (schema {m.schema}, created {m.created}) in {store.url}")
    print("compatibility key fields:")
    for name, value in m.fields.items():
        print(f"  {name} = {value}")
    print("facts recorded at the cold boot:")
    for name, value in m.facts.items():
        print(f"  {name} = {json.dumps(value)}")
    chunks = sum(len(t.chunks) for t in m.tensors)
    print(f"tensors: {len(m.tensors)}, {m.tensor_bytes / 1e9:.3f} GB in {chunks} chunks")
    for t in m.tensors:
        print(f"  {t.name} {t.dtype} {list(t.shape)} ({len(t.chunks)} chunks)")
    print(f"files: {len(m.files)}")
    for f in m.files:
        print(f"  {f.path} ({f.chunk.size} bytes, {f.chunk.hash[:16]})")
    for name, value in m.extra.items():
        print(f"{name}: {value}")
    return 0


def _verify(args) -> int:
    from warmboot.snapshot.ops import manifest_refs, resolve_keys, verify_snapshot

    store = _open(args.store)
    for key in resolve_keys(store, args.key):
        total = sum(manifest_refs(store, key)[0].values())
        t0 = time.perf_counter()
        with _progress(total, f"verify {key[:12]}") as bar:
            verify_snapshot(store, key, bar)
        dt = time.perf_counter() - t0
        print(f"{key}: ok, {total / 1e9:.3f} GB in {dt:.2f}s ({total / 1e9 / dt:.2f} GB/s)")
    return 0


def _rm(args) -> int:
    from warmboot.snapshot.ops import remove_snapshot, resolve_keys

    store = _open(args.store)
    (key,) = resolve_keys(store, args.key)
    freed = remove_snapshot(store, key)
    print(f"removed {key}; freed {freed / 1e9:.3f} GB of chunks nothing else uses")
    return 0


def _copy(src, dst, prefix: str | None, verb: str) -> int:
    from warmboot.snapshot.ops import copy_snapshot, manifest_refs, resolve_keys

    for key in resolve_keys(src, prefix):
        total = sum(manifest_refs(src, key)[0].values())
        with _progress(total, f"{verb} {key[:12]}") as bar:
            moved = copy_snapshot(src, dst, key, bar)
            bar(total - moved)
        print(f"{verb} {key}: {moved / 1e9:.3f} GB moved ({(total - moved) / 1e9:.3f} GB present)")
    return 0


def _push(args) -> int:
    return _copy(_open(args.store), _open(args.to), args.key, "push")


def _pull(args) -> int:
    return _copy(_open(args.source), _open(args.store), args.key, "pull")
