"""The store fault matrix (tier A, in-process engine): every hostile, broken or stalled store
ends in a healthy engine with the cold boot's greedy tokens within a stated deadline, and
nothing outside the store is written or deleted. Tier-P cases are in test_launcher.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.store_faults import StallingProxy, tree
from tests.test_snapshot_engine import ENGINE_ARGS, outputs
from warmboot import LLM
from warmboot.snapshot import process_image, s3_store
from warmboot.snapshot import publish as publish_mod
from warmboot.snapshot.image import IntegrityError, Manifest, SnapshotError
from warmboot.snapshot.lease import try_lease
from warmboot.snapshot.ops import remove_snapshot
from warmboot.snapshot.store import LocalStore, S3Store, StoreError, open_store

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TIMEOUT_S = 2.0
"""The engines' ``snapshot_timeout`` here: a stalled step is abandoned after this long."""
DEADLINE_S = 30.0
"""Every fault must end in a ready engine this soon (a cold boot of the tiny model takes
about a second; the rest is the stall the timeout cuts short)."""


def boot(path, store, **kw) -> LLM:
    args = ENGINE_ARGS | {"snapshot_timeout": TIMEOUT_S} | kw
    return LLM(str(path), **args, snapshot_store=str(store))


def healthy(path, store, golden, path_taken: str = "cold", reason: str = "", **kw) -> LLM:
    """Boot against ``store``: ready within the deadline, on ``path_taken`` with ``reason``,
    answering exactly as the cold reference."""
    t0 = time.monotonic()
    llm = boot(path, store, **kw)
    took = time.monotonic() - t0
    info = llm.engine.start_info
    assert took < DEADLINE_S, f"ready after {took:.1f} s: {info.reason}"
    assert info.path == path_taken, info.reason
    assert reason in info.reason, info.reason
    assert outputs(llm) == golden["outputs"]
    return llm


@pytest.fixture(scope="module")
def golden(path, tmp_path_factory):
    """A published store (16 KiB chunks) and the cold engine's outputs."""
    root = tmp_path_factory.mktemp("faults") / "store"
    mp = pytest.MonkeyPatch()
    mp.setattr(publish_mod, "CHUNK_BYTES", 16 << 10)
    cold = boot(path, root)
    mp.undo()
    (key,) = LocalStore(root).list_keys()
    return {"root": root, "key": key, "outputs": outputs(cold)}


@pytest.fixture
def store(golden, tmp_path) -> LocalStore:
    root = tmp_path / "store"
    shutil.copytree(golden["root"], root)
    return LocalStore(root)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside the store with an old file, where links in the store point."""
    d = tmp_path / "outside"
    d.mkdir()
    old = d / "precious.bin"
    old.write_bytes(b"x" * 100)
    os.utime(old, (1, 1))  # older than any stale-tmp threshold
    return d


def chunk_of(store: LocalStore, key: str) -> Path:
    manifest = Manifest.from_json(store.get_manifest(key))
    biggest = max(manifest.tensors, key=lambda t: t.nbytes)
    return store.local_chunk_path(biggest.chunks[0].hash)


# -- links: nothing is written or deleted where they point -----------------------------------------
@pytest.mark.parametrize("linked", ["tmp", "manifests", "chunks", "chunks/xx", "leases"])
def test_links_inside_an_empty_store_are_never_written_through(
    path, golden, tmp_path, outside, linked
):
    root = tmp_path / "fresh"
    (root / "chunks").mkdir(parents=True)
    if linked == "chunks/xx":
        for i in range(256):  # every prefix a chunk can have
            (root / "chunks" / f"{i:02x}").symlink_to(outside, target_is_directory=True)
    else:
        if linked == "chunks":
            (root / "chunks").rmdir()
        (root / linked).symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    healthy(path, root, golden)  # a cold boot whose publish is refused (or not possible)
    assert tree(outside) == before
    assert LocalStore(root).list_keys() == []


def test_records_are_never_written_or_read_through_links(tmp_path, outside):
    """A store's records (``start_costs``) keep the rules of its other files."""
    root = tmp_path / "fresh"
    (root / "records").mkdir(parents=True)
    store = LocalStore(root)
    store.put_record("start-costs-x", b"{}")
    assert store.get_record("start-costs-x") == b"{}" and store.get_record("none") is None
    with pytest.raises(SnapshotError, match="is not a key"):
        store.put_record("../escape", b"{}")
    shutil.rmtree(root / "records")
    (root / "records").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    with pytest.raises(StoreError, match="not a plain directory"):
        store.put_record("start-costs-x", b"{}")
    assert tree(outside) == before
    (root / "records").unlink()
    (root / "records").mkdir()
    (root / "records" / "start-costs-x.json").symlink_to(outside / "precious.bin")
    with pytest.raises(IntegrityError, match="outside the store"):
        store.get_record("start-costs-x")


def test_gc_never_deletes_through_a_linked_chunk_directory(golden, store, outside):
    h = chunk_of(store, golden["key"]).name
    (outside / h).write_bytes(b"not the store's")
    linked = store.root / "chunks" / "zz"
    linked.symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    remove_snapshot(store, golden["key"])
    assert tree(outside) == before
    assert store.list_chunks() == {}


def test_a_chunk_that_is_a_directory_or_a_device_is_refused(path, golden, store):
    chunk = chunk_of(store, golden["key"])
    chunk.unlink()
    chunk.mkdir()
    healthy(path, store.root, golden, reason="is not a regular file")
    chunk.rmdir()
    chunk.symlink_to("/dev/zero")
    healthy(path, store.root, golden, reason="leads outside the store")


def test_a_manifests_directory_that_is_a_file_boots_cold(path, golden, store):
    shutil.rmtree(store.root / "manifests")
    (store.root / "manifests").write_text("not a directory")
    healthy(path, store.root, golden, reason="cannot be opened as a store file")


# -- the running engine is immune to the store --------------------------------------------------
@pytest.mark.parametrize("damage", ["edit", "truncate", "remove"])
def test_a_restored_engine_ignores_what_happens_to_the_store(path, golden, store, damage):
    # NOTE: no prefix cache, so the second round of the same prompts computes exactly alike
    llm = healthy(path, store.root, golden, "restored_image", enable_prefix_caching=False)
    for chunk in (store.root / "chunks").glob("*/*"):
        if damage == "edit":
            data = bytearray(chunk.read_bytes())
            data[: len(data) // 2] = bytes(len(data) // 2)
            chunk.write_bytes(bytes(data))  # in place: the same inode
        elif damage == "truncate":
            os.truncate(chunk, 0)  # a mapped page past the end would be SIGBUS
        else:
            chunk.unlink()
    assert outputs(llm) == golden["outputs"]


# -- a stalled or failing local store ---------------------------------------------------------
def _hang(monkeypatch, method: str) -> threading.Event:
    """``LocalStore.method`` blocks until the returned event is set (at most a minute)."""
    release, real = threading.Event(), getattr(LocalStore, method)

    def hang(self, h, buf):
        release.wait(60)
        return real(self, h, buf)

    monkeypatch.setattr(LocalStore, method, hang)
    return release


def test_a_local_read_that_never_returns_is_abandoned(path, golden, store, monkeypatch):
    release = _hang(monkeypatch, "read_chunk")
    try:
        healthy(path, store.root, golden, reason="snapshot restore: no progress for 2 s")
    finally:
        release.set()


def test_a_publish_into_a_full_store_cleans_up_after_itself(path, golden, tmp_path, monkeypatch):
    root, real, calls = tmp_path / "full", LocalStore.put_chunk, []

    def fill_up(self, h, data):
        calls.append(h)
        if len(calls) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, h, data)

    monkeypatch.setattr(LocalStore, "put_chunk", fill_up)
    healthy(path, root, golden, reason="publish failed: OSError: [Errno 28]")
    store = LocalStore(root)
    assert store.list_keys() == [] and store.list_chunks() == {}, "a failed publish left chunks"
    assert not list((root / "tmp").iterdir())


def test_a_read_only_store_restores_and_a_cold_boot_serves(path, golden, store, monkeypatch):
    """EROFS on every write (as root, permissions would not stop the writes)."""
    real = LocalStore._dir

    def read_only(self, *parts, create=False):
        if create:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, *parts)

    monkeypatch.setattr(LocalStore, "_dir", read_only)
    healthy(path, store.root, golden, path_taken="restored_image")
    healthy(path, store.root.parent / "empty-ro", golden)


def test_a_stalled_publish_does_not_hold_the_start(path, golden, tmp_path, monkeypatch):
    release = _hang(monkeypatch, "put_chunk")
    root = tmp_path / "stalled"
    try:
        healthy(path, root, golden, reason="publish failed: snapshot publish: no progress for 2 s")
    finally:
        release.set()
    _wait_for_threads("store-snapshot publish")
    assert LocalStore(root).list_keys() == [], "an abandoned publish wrote its manifest"


def _wait_for_threads(prefix: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(t.name.startswith(prefix[:26]) for t in threading.enumerate()):
        assert time.monotonic() < deadline, f"{prefix} thread still running"
        time.sleep(0.05)


# -- hostile leases --------------------------------------------------------------------------
def _lease_path(root: Path, key: str) -> Path:
    return root / "leases" / f"publish-{key}.lease"


@pytest.mark.parametrize("lease", ["fifo", "garbage", "huge", "link"])
def test_a_hostile_lease_never_blocks_a_start(path, golden, tmp_path, outside, lease):
    root = tmp_path / "leased"
    probe = boot(path, root, snapshot_publish=False)  # learns the key; publishes nothing
    target = _lease_path(root, probe.engine.startup.snapshot.key)
    target.parent.mkdir(parents=True)
    if lease == "fifo":
        os.mkfifo(target)
    elif lease == "garbage":
        target.write_bytes(b"{nope")
    elif lease == "huge":
        target.write_bytes(b"[" * 100_000)
    else:
        target.symlink_to(outside / "precious.bin")
    before = tree(outside)
    key = probe.engine.startup.snapshot.key
    healthy(path, root, golden, reason=f"published {key}")  # the garbage lease is replaced
    assert tree(outside) == before


def test_one_publisher_per_key(path, golden, tmp_path):
    """A fresh lease held by another server: this start serves without publishing; once the
    lease has expired (its holder died), the next start takes it over and publishes."""
    root = tmp_path / "raced"
    store = LocalStore(root)
    key = boot(path, root, snapshot_publish=False).engine.startup.snapshot.key
    held = try_lease(store, f"publish-{key}", ttl_s=600)
    assert held is not None
    healthy(path, root, golden, reason="holds the publish lease")
    assert store.list_keys() == []
    held.release()
    assert try_lease(store, f"publish-{key}", ttl_s=-1) is not None  # an expired one
    healthy(path, root, golden, reason=f"published {key}")
    assert store.list_keys() == [key]
    assert store.get_lease(f"publish-{key}") is None, "the publisher released its lease"


# -- relocation: a store is data, not a place --------------------------------------------------
def test_a_copied_store_and_another_working_directory_restore(path, golden, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(golden["root"], moved)
    monkeypatch.chdir(tmp_path / "elsewhere")
    healthy(path, moved, golden, path_taken="restored_image")
    healthy(path, "copy", golden, path_taken="restored_image")  # a relative path too


def test_sandbox_hidden_cpu_flags_do_not_change_the_key(path, monkeypatch):
    """gVisor's /proc/cpuinfo hides flags; with the host's reading handed in (as the launcher
    does), the worker computes the same tier-A key as an engine outside the sandbox."""
    from warmboot import host as host_mod
    from warmboot.snapshot import key as key_mod

    outside = key_mod.device_fields(__import__("torch").device("cpu"))
    host = host_mod.host_cpu_features()
    model, _, flags = host.partition(" | ")
    hidden = " ".join(f for f in flags.split() if not f.startswith(("amx", "avx512")))
    monkeypatch.setattr(host_mod, "_cpu_info", lambda: (model, hidden))
    host_mod.host_cpu_features.cache_clear()
    try:
        inside = key_mod.device_fields(__import__("torch").device("cpu"))
        monkeypatch.setenv(host_mod.HOST_CPU_ENV, host)
        host_mod.host_cpu_features.cache_clear()
        handed_in = key_mod.device_fields(__import__("torch").device("cpu"))
    finally:
        host_mod.host_cpu_features.cache_clear()
    assert handed_in == outside
    assert inside != outside or hidden == flags


# -- garbage collection knows every manifest kind, and the CLI stays calm -----------------------
def test_rm_keeps_the_chunks_a_process_image_maps(golden, store):
    refs = Manifest.from_json(store.get_manifest(golden["key"])).chunk_refs()
    image = json.dumps(
        {
            "schema": process_image.SCHEMA,
            "kind": process_image.KIND,
            "key": "p",
            "canary": [],
            "files": [],
            "mapped_chunks": refs,
        }
    ).encode()
    store.put_manifest(process_image.manifest_key("p"), image)
    assert remove_snapshot(store, golden["key"]) == 0
    assert set(store.list_chunks()) == set(refs)
    assert remove_snapshot(store, process_image.manifest_key("p")) == sum(refs.values())


@pytest.mark.parametrize(
    "bad",
    [
        b'{"schema": 1, "kind": "warmboot-process-snapshot"}',
        (
            b'{"schema": 1, "kind": "warmboot-process-snapshot", "canary": [], "files": [{"name": '
            b'"../x", "chunks": []}]}'
        ),
        (
            b'{"schema": 1, "kind": "warmboot-process-snapshot", "canary": [], "files": [], '
            b'"mapped_chunks": {"../../etc/passwd": 1}}'
        ),
        b"[" * 100_000,
    ],
    ids=["no-files", "escaping-name", "bad-mapped-chunk", "deep"],
)
def test_malformed_process_manifests_are_messages(golden, store, bad, capsys):
    from warmboot.cli import main

    store.put_manifest(process_image.manifest_key("bad"), bad)
    for cmd in (["ls"], ["verify"], ["rm", golden["key"]], ["rm", "process-bad"]):
        code = main(["snapshot", *cmd, "--store", str(store.root)])
        err = capsys.readouterr().err
        assert "Traceback" not in err, (cmd, err)
        assert code in (0, 1), (cmd, code, err)
    assert store.list_keys() == []


# -- S3: an endpoint that stops answering, or was never there ----------------------------------
@pytest.fixture
def stalling_s3(request, monkeypatch):
    """A moto server behind a stalling proxy; the S3 client's read timeout shortened so the
    abandoned threads end soon after a stall is lifted."""
    s3_endpoint = request.getfixturevalue("s3_endpoint")
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = StallingProxy((host, int(port)))
    monkeypatch.setattr(s3_store, "S3_READ_TIMEOUT_S", 1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    yield proxy, f"s3://snaps/{request.node.name}"
    proxy.close()


def test_s3_stalling_mid_restore_boots_cold_within_the_deadline(
    path, golden, stalling_s3, monkeypatch
):
    proxy, url = stalling_s3
    first = boot(path, url)  # publishes through the proxy
    assert first.engine.start_info.path == "cold"
    real = S3Store.read_chunk

    def stall_then_read(self, h, out):
        proxy.stall()
        return real(self, h, out)

    monkeypatch.setattr(S3Store, "read_chunk", stall_then_read)
    try:
        healthy(
            path,
            url,
            golden,
            reason="snapshot restore: no progress for 2 s",
            snapshot_publish=False,
        )
    finally:
        proxy.resume()


def test_s3_stalling_during_publish_does_not_hold_the_start(path, golden, stalling_s3, monkeypatch):
    proxy, url = stalling_s3
    real = S3Store.put_chunk

    def stall_then_put(self, h, data):
        proxy.stall()
        return real(self, h, data)

    monkeypatch.setattr(S3Store, "put_chunk", stall_then_put)
    try:
        healthy(path, url, golden, reason="publish failed: snapshot publish: no progress for 2 s")
    finally:
        proxy.resume()
    monkeypatch.setattr(S3Store, "put_chunk", real)
    _wait_for_threads("store-snapshot publish")
    assert open_store(url).list_keys() == [], "an abandoned publish wrote its manifest"


def test_an_s3_endpoint_that_is_not_there_boots_cold(path, golden, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    healthy(path, "s3://snaps/none", golden, reason="snapshot store s3://snaps/none")


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_racing_publishers_get_one_lease(kind, tmp_path, request):
    """Four servers asking for one key's lease at the same moment: exactly one gets it (a
    hard link locally, a conditional PUT on S3); after its release the next one can."""
    if kind == "s3":
        request.getfixturevalue("s3_endpoint")
        store = open_store(f"s3://snaps/{request.node.name}")
    else:
        store = LocalStore(tmp_path / "raced")
    barrier, won = threading.Barrier(4), []

    def race() -> None:
        barrier.wait()
        lease = try_lease(store, "publish-k")
        if lease is not None:
            won.append(lease)

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    won[0].release()
    assert try_lease(store, "publish-k") is not None


KILL_SCRIPT = """
import os, signal, sys
from warmboot import LLM
from warmboot.snapshot import boot, lease, store
point, seen = sys.argv[3], []
def die():
    os.kill(os.getpid(), signal.SIGKILL)
real_lease, real_put, real_manifest = lease.try_lease, store.LocalStore.put_chunk, store.LocalStore.put_manifest
def on_lease(*a, **k):
    got = real_lease(*a, **k)
    if point == "leased": die()
    return got
def on_chunk(self, h, data):
    seen.append(h)
    if point == "chunks" and len(seen) == 3: die()
    return real_put(self, h, data)
def on_manifest(self, key, data):
    if point == "manifest": die()
    real_manifest(self, key, data)
    if point == "published": die()
boot.try_lease, store.LocalStore.put_chunk, store.LocalStore.put_manifest = on_lease, on_chunk, on_manifest
LLM(sys.argv[1], snapshot_store=sys.argv[2], max_model_len=128, block_size=4, num_kv_blocks=64)
"""


@pytest.mark.parametrize("point", ["leased", "chunks", "manifest", "published"])
def test_kill_9_at_each_point_of_a_publishing_start(path, golden, tmp_path, point):
    """A publisher killed with -9 (lease taken, chunks half written, before the manifest,
    after it): the next start is healthy at once (a dead holder's lease is not waited out)
    and publishes, or restores what was published."""
    import signal
    import subprocess
    import sys

    root = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(path), str(root), point],
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    published = point == "published"
    assert bool(LocalStore(root).list_keys()) == published
    healthy(path, root, golden, path_taken="restored_image" if published else "cold")
    healthy(path, root, golden, path_taken="restored_image")
