"""The start path chosen by what each path cost here (``snapshot.start_costs``): a restore
that measured slower than a cold start is skipped, with the reason, and nothing republished."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.snapshot import start_costs
from warmboot.snapshot.store import LocalStore

ARGS = dict(max_model_len=64, block_size=4, num_kv_blocks=64)
PROMPTS = random_prompts([5, 11], VOCAB_SIZE, seed=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def by_cost(monkeypatch, own_cache):
    monkeypatch.setenv(start_costs.ENV, "1")


def _start(path, store) -> tuple[str, str, list]:
    llm = LLM(str(path), snapshot_store=str(store), **ARGS)
    info = llm.engine.start_info
    return info.path, info.reason, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_costs_are_recorded_and_compared(by_cost):
    start_costs.record("k", "cold", {"load_weights": 1.0, "compile": 30.0, "warmup": 0.5})
    assert start_costs.cold_is_quicker("k") is None  # NOTE: no restore on record yet
    start_costs.record("k", "restored_image", {"restore_weights": 2.0, "warmup": 0.5})
    assert json.loads(start_costs.costs_path().read_text())["k"] == {
        "cold": [1.5],
        "restored_image": [2.5],
    }
    assert "1.50s to serve against 2.50s restored" in start_costs.cold_is_quicker("k")
    start_costs.record("k", "restored_image", {"restore_weights": 0.5})
    assert start_costs.cold_is_quicker("k") is None  # NOTE: medians 1.50 against 1.50
    start_costs.costs_path().write_text('{"k": "junk", "j": {"cold": "x", "restored_image": 1}}')
    assert start_costs.cold_is_quicker("k") is None and start_costs.cold_is_quicker("j") is None
    start_costs.costs_path().write_text('{"k": {"cold": 1.0, "restored_image": [true, 3, -1]}}')
    assert "1.00s to serve against 3.00s restored" in start_costs.cold_is_quicker("k"), (
        "an older file's single figure is read; a figure that is no number of seconds is not"
    )


def test_a_path_costs_the_median_of_its_latest_figures(by_cost):
    """One slow start does not decide: a path's cost is the median of its latest figures."""
    for seconds in (2.0, 2.1, 3.9):  # NOTE: the last start ran beside a neighbour's load
        start_costs.record_launch("p", "local", seconds)
    for seconds in (3.0, 3.1, 2.9):
        start_costs.record_launch("p", "restored_process", seconds)
    assert "2.10s against 3.00s for the process image" in start_costs.local_is_quicker("p")
    for seconds in range(10):
        start_costs.record_launch("p", "local", 9.0 + seconds)
    kept = json.loads(start_costs.costs_path().read_text())["process:p"]["local"]
    assert kept == [14.0, 15.0, 16.0, 17.0, 18.0] and start_costs.KEEP == 5
    assert start_costs.local_is_quicker("p") is None


def test_a_close_call_is_measured_again(by_cost):
    """Paths within ``CLOSE`` of each other are each tried until they have ``TRIES`` figures;
    a clear loser is not tried again."""
    start_costs.record_launch("p", "restored_process", 2.6)
    start_costs.record_launch("p", "local", 2.8)  # NOTE: one figure, 8% slower: again
    assert "tried again, a close call (2.80s against 2.60s" in start_costs.local_is_quicker("p")
    start_costs.record_launch("p", "local", 2.2)  # NOTE: median 2.50: quicker, but the
    assert start_costs.local_is_quicker("p") is None  # restore has one figure: again
    start_costs.record_launch("p", "restored_process", 2.7)
    assert start_costs.local_is_quicker("p") is None  # NOTE: two figures
    start_costs.record_launch("p", "restored_process", 2.64)
    assert "measured quicker here (2.50s against 2.64s" in start_costs.local_is_quicker("p")
    start_costs.record_launch("q", "restored_process", 2.0)
    start_costs.record_launch("q", "local", 2.4)  # NOTE: 20% slower: not a close call
    assert start_costs.local_is_quicker("q") is None
    start_costs.record("k", "restored_image", {"restore_weights": 1.0})
    start_costs.record("k", "cold", {"load_weights": 1.1})
    assert start_costs.cold_is_quicker("k") is None, "only where the caller explores"
    assert "cold start tried again, a close call" in start_costs.cold_is_quicker("k", True)


def test_a_slower_restore_is_skipped_for_a_cold_start(by_cost, path, tmp_path):
    store = tmp_path / "store"
    first = _start(path, store)
    assert first[0] == "cold"
    (key,) = LocalStore(store).list_keys()
    restored = _start(path, store)
    assert restored[0] == "restored_image" and restored[2] == first[2]
    costs = json.loads(start_costs.costs_path().read_text())[key]
    assert costs.keys() == {"cold", "restored_image"}
    costs["restored_image"] = [costs["cold"][0] + 5.0]  # NOTE: a small model, a slow store
    start_costs.costs_path().write_text(json.dumps({key: costs}))
    manifests = sorted(p.stat().st_mtime_ns for p in (store / "manifests").iterdir())
    cold = _start(path, store)
    assert cold[0] == "cold" and "cold start measured quicker" in cold[1], cold[1]
    assert cold[2] == first[2]
    assert sorted(p.stat().st_mtime_ns for p in (store / "manifests").iterdir()) == manifests


def test_a_restore_alone_on_record_tries_a_cold_start_once(by_cost, path, tmp_path):
    """An image made where this host's costs are not kept (in gVisor, elsewhere) has only
    its restore on record here: a CPU engine boots cold once to measure that, publishes
    nothing, and from then on the figures decide."""
    store = tmp_path / "store"
    first = _start(path, store)
    (key,) = LocalStore(store).list_keys()
    start_costs.costs_path().write_text(json.dumps({key: {"restored_image": 0.5}}))
    shutil.rmtree(store / "records")  # NOTE: nor in the store (a sandboxed worker shares none)
    assert start_costs.cold_is_quicker(key) is None, "only where the caller explores"
    manifests = sorted(p.stat().st_mtime_ns for p in (store / "manifests").iterdir())
    tried = _start(path, store)
    assert tried[0] == "cold" and "cold start tried once" in tried[1], tried[1]
    assert tried[2] == first[2]
    assert sorted(p.stat().st_mtime_ns for p in (store / "manifests").iterdir()) == manifests
    costs = json.loads(start_costs.costs_path().read_text())[key]
    assert costs.keys() == {"cold", "restored_image"}
    decided = _start(path, store)
    (restored,), (cold,) = costs["restored_image"], costs["cold"]
    quicker = "restored_image" if restored <= cold else "cold"
    if max(restored, cold) <= start_costs.CLOSE * min(restored, cold):  # NOTE: a close call:
        quicker = {"cold": "restored_image", "restored_image": "cold"}[quicker]  # the other
    assert decided[0] == quicker and decided[2] == first[2], (decided[:2], costs)


def test_launch_costs_are_compared(by_cost):
    assert start_costs.local_is_quicker("p") is None  # NOTE: nothing on record
    start_costs.record_launch("p", "restored_process", 4.5)
    assert "tried once, to measure it (the process image's restore took 4.50s)" in (
        start_costs.local_is_quicker("p")  # NOTE: no local figure yet: one trial
    )
    start_costs.record_launch("p", "local", 6.0)
    assert start_costs.local_is_quicker("p") is None
    start_costs.record_launch("p", "restored_process", 10.5)  # NOTE: medians 7.50 and 6.00
    assert "measured quicker here (6.00s against 7.50s" in start_costs.local_is_quicker("p")


@pytest.mark.parametrize("recorded_by", ["this host", "another host"])
def test_the_launcher_skips_a_slower_process_image(
    by_cost, own_cache, path, tmp_path, monkeypatch, recorded_by
):
    """With a process image on record as slower than a start outside gVisor, the launcher
    starts locally without trying tier P, and records what that start cost. A new replica
    (an empty cache) decides by what another host of its kind recorded in the store. Its
    caller is told where the next start will run the engine (``serve``'s spare hint)."""
    from warmboot.launcher import launch as launch_mod
    from warmboot.launcher import sandbox
    from warmboot.launcher import spec as spec_mod

    monkeypatch.setattr(sandbox, "runsc_status", lambda: ("runsc-test", None))
    engine = {"model": str(path), **ARGS}
    told = []
    cfg = launch_mod.LaunchConfig(
        engine, str(tmp_path / "store"), work_dir=tmp_path / "work", on_recorded=told.append
    )
    fields = spec_mod.process_key_fields(engine, "runsc-test", launch_mod.worker_spec(cfg))
    key = spec_mod.process_key(fields)
    store = LocalStore(tmp_path / "store")
    if recorded_by == "another host":
        monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "other-host"))
        start_costs.record_launch(key, "local", 3.0, store)
    start_costs.record_launch(key, "restored_process", 50.0, store)  # NOTE: tried once, or:
    monkeypatch.setenv("WARMBOOT_CACHE", str(own_cache))  # measured quicker elsewhere
    expected = {"this host": "tried once", "another host": "measured quicker here (3.00s"}

    def no_restore(*args):
        raise AssertionError("tier P was tried")

    monkeypatch.setattr(launch_mod, "_try_restore", no_restore)
    client = launch_mod.launch(cfg)
    try:
        info = client.start_info
        assert f"a start outside gVisor {expected[recorded_by]}" in info.reason, info.reason
        recorded = json.loads(start_costs.costs_path().read_text())[f"process:{key}"]
        once = start_costs.one_time(client.stats()["startup_times"])  # NOTE: e.g. a publish
        assert recorded["local"] == [round(info.ready_s - once, 4)] and 0 < info.ready_s < 50
        shared = _shared(store)[f"process:{key}"]["local"]
        assert shared[-1] == recorded["local"][0] and len(shared) == 1 + (
            recorded_by != "this host"
        )
    finally:
        client.shutdown()
    assert "measured quicker" in start_costs.local_is_quicker(key, store), "by measurement"
    assert told == [False], "the next start runs the engine outside gVisor too"


def _shared(store: LocalStore) -> dict:
    return json.loads(store.get_record(f"start-costs-{start_costs.host_class()}"))


def test_hosts_of_a_kind_share_their_costs_through_the_store(by_cost, tmp_path, monkeypatch):
    """A host with no figures of its own for a path reads those of the hosts of its kind in
    the store's record; its own figures, where it has some, decide."""
    store = LocalStore(tmp_path / "store")
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "first-host"))
    for seconds in (3.0, 3.2, 3.1):
        start_costs.record_launch("p", "restored_process", seconds, store)
    for seconds in (2.0, 2.2):
        start_costs.record_launch("p", "local", seconds, store)
    start_costs.record("k", "restored_image", {"restore_weights": 1.0}, store)
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "new-replica"))
    assert start_costs.local_is_quicker("p") is None, "without the store: nothing on record"
    assert "measured quicker here (2.10s against 3.10s" in start_costs.local_is_quicker("p", store)
    assert "cold start tried once" in start_costs.cold_is_quicker("k", True, store)
    start_costs.record_launch("p", "local", 4.0, store)  # NOTE: this host's own figure decides
    assert start_costs.local_is_quicker("p", store) is None
    assert _shared(store)["process:p"]["local"] == [2.0, 2.2, 4.0]
    monkeypatch.setattr(start_costs, "host_class", lambda: "another-kind")
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path / "third-host"))
    assert start_costs.local_is_quicker("p", store) is None, "another kind of host: not shared"


def test_a_bad_record_or_store_shares_nothing(by_cost, tmp_path, monkeypatch, caplog):
    """The record is data: junk, figures that are no seconds and an oversized record are
    read as nothing; a store that cannot be written keeps the figure here; a sandboxed
    worker neither reads nor writes the record."""
    store = LocalStore(tmp_path / "store")
    name = f"start-costs-{start_costs.host_class()}"
    for junk in (b"[1, 2]", b"{not json", b'{"process:p": {"local": ["x", -1, true]}}'):
        store.put_record(name, junk)
        assert start_costs.local_is_quicker("p", store) is None
    store.put_record(name, json.dumps({"process:p": {"restored_process": [1.0]}}).encode())
    assert "tried once" in start_costs.local_is_quicker("p", store)
    store.put_record(name, b" " * (1 << 20) + b'{"process:p": {"restored_process": [1.0]}}')
    assert store.get_record(name) is None and start_costs.local_is_quicker("p", store) is None
    monkeypatch.setenv("WARMBOOT_HOST_NATIVE", "/host/native")  # NOTE: a sandboxed worker
    start_costs.record_launch("p", "local", 2.0, store)
    assert store.get_record(name) is None and start_costs.local_is_quicker("p", store) is None
    monkeypatch.delenv("WARMBOOT_HOST_NATIVE")

    def refuse(*args):
        raise OSError("read-only file system")

    monkeypatch.setattr(store, "put_record", refuse)
    with caplog.at_level("INFO", logger="warmboot.snapshot.start_costs"):
        start_costs.record_launch("q", "local", 2.0, store)
    assert "not shared through" in caplog.text and "read-only" in caplog.text
    assert json.loads(start_costs.costs_path().read_text())["process:q"] == {"local": [2.0]}


def test_a_stalled_store_holds_no_start(by_cost, tmp_path, monkeypatch):
    """A store that never answers for its record costs a start ``RECORD_TIMEOUT_S``, then the
    start goes on with this host's figures (and keeps its own here)."""
    import threading
    import time

    store = LocalStore(tmp_path / "store")
    start_costs.record_launch("p", "restored_process", 3.0, store)
    never = threading.Event()
    monkeypatch.setattr(start_costs, "RECORD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(store, "get_record", lambda name: never.wait())
    monkeypatch.setattr(store, "put_record", lambda name, data: never.wait())
    t0 = time.monotonic()
    assert "tried once" in start_costs.local_is_quicker("p", store)
    start_costs.record_launch("p", "local", 2.0, store)
    assert time.monotonic() - t0 < 2.0
    assert json.loads(start_costs.costs_path().read_text())["process:p"]["local"] == [2.0]
    never.set()
