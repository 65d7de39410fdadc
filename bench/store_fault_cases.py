"""``bench.store_faults``'s faults: each damages a fresh copy of the published store (or
stalls a read, fills the disk, holds the lease) and names the store to boot against; and the
S3 server (moto behind a stalling proxy) they and ``bench.fleet`` use."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.servers import free_port

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
    stack.enter_context(
        _patched(
            LocalStore, "read_chunk", lambda self, h, out: release.wait(120) and real(self, h, out)
        )
    )
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
    stack.enter_context(
        _patched(S3Store, method, lambda self, h, buf: proxy.stall() or real(self, h, buf))
    )


def f_s3_stall_restore(stack, ctx) -> str:
    _stall_s3_on(stack, ctx, "read_chunk")
    return ctx["s3"]


def f_s3_stall_publish(stack, ctx) -> str:
    _stall_s3_on(stack, ctx, "put_chunk")
    return ctx["s3"] + "-empty"


def f_s3_absent(stack, ctx) -> str:
    port = free_port()
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
