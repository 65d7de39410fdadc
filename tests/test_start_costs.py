"""The start path chosen by what each path cost here (``snapshot.start_costs``): a restore
that measured slower than a cold start is skipped, with the reason, and nothing republished."""

from __future__ import annotations

import json

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


def test_the_launcher_skips_a_slower_process_image(by_cost, path, tmp_path, monkeypatch):
    """With a process image on record as slower than a start outside gVisor, the launcher
    starts locally without trying tier P, and records what that start cost."""
    from warmboot.launcher import launch as launch_mod
    from warmboot.launcher import sandbox
    from warmboot.launcher import spec as spec_mod

    monkeypatch.setattr(sandbox, "runsc_status", lambda: ("runsc-test", None))
    engine = {"model": str(path), **ARGS}
    cfg = launch_mod.LaunchConfig(engine, str(tmp_path / "store"), work_dir=tmp_path / "work")
    fields = spec_mod.process_key_fields(engine, "runsc-test", launch_mod.worker_spec(cfg))
    key = spec_mod.process_key(fields)
    start_costs.record_launch(key, "restored_process", 50.0)  # NOTE: no local figure: tried once

    def no_restore(*args):
        raise AssertionError("tier P was tried")

    monkeypatch.setattr(launch_mod, "_try_restore", no_restore)
    client = launch_mod.launch(cfg)
    try:
        info = client.start_info
        assert "a start outside gVisor tried once" in info.reason, info.reason
        recorded = json.loads(start_costs.costs_path().read_text())[f"process:{key}"]
        once = start_costs.one_time(client.stats()["startup_times"])  # NOTE: e.g. a publish
        assert recorded["local"] == [round(info.ready_s - once, 4)] and 0 < info.ready_s < 50
    finally:
        client.shutdown()
    assert "measured quicker" in start_costs.local_is_quicker(key), "from now on by measurement"
