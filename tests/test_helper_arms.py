"""``device.helper_arms``: steps are lent the helpers or not, whichever has been faster of late
for their size, and the choice follows a change in which is faster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from warmboot.device import helper_arms
from warmboot.device.helper_arms import EXPLORE, HelperArms


class _Host:
    """A stand-in helper pool: a step takes ``cost[lent]`` seconds of a fake clock (the
    choice is tested, not the machine's timer: a loaded CI machine's sleeps overshoot)."""

    def __init__(self) -> None:
        self.lent = 0
        self.cost = {0: 0.002, 1: 0.008}
        self.now = 0.0

    def lend(self, n: int) -> int:
        self.lent = int(bool(n))
        return n

    def step(self) -> None:
        self.now += self.cost[self.lent]


@pytest.fixture(autouse=True)
def _fake_clock(monkeypatch):
    host = _Host()
    monkeypatch.setattr(helper_arms, "time", SimpleNamespace(perf_counter=lambda: host.now))
    return host


def _run(arms: HelperArms, host: _Host, steps: int, tokens: int = 32) -> list[int]:
    ways = []
    for _ in range(steps):
        arms.run(tokens, host.step)
        ways.append(host.lent)
    return ways


def test_the_faster_way_serves_and_the_other_is_retried(_fake_clock):
    host = _fake_clock
    arms = HelperArms(1, host.lend)
    ways = _run(arms, host, 4 * EXPLORE)
    assert ways[:EXPLORE] == [1] * (EXPLORE - 1) + [0], "lent first; solo timed at EXPLORE"
    retried = [i + 1 for i, lent in enumerate(ways) if lent and i >= EXPLORE]
    assert retried == list(range(2 * EXPLORE, 4 * EXPLORE + 1, EXPLORE)), "one step in EXPLORE"
    assert arms.steps == [ways.count(0), ways.count(1)]
    solo, lent = arms.means_ms()[(32).bit_length()]
    assert solo < lent
    host.cost = {0: 0.008, 1: 0.002}  # NOTE: the host's core fell idle: now lending pays
    ways = _run(arms, host, 6 * EXPLORE)
    assert ways[-2 * EXPLORE :].count(1) == 2 * EXPLORE - 2, "the choice follows the change"


def test_a_new_size_takes_the_nearest_timed_sizes_way(_fake_clock):
    host = _fake_clock
    arms = HelperArms(1, host.lend)
    _run(arms, host, 2 * EXPLORE, tokens=1)
    assert arms.means_ms().keys() == {1}
    _run(arms, host, 2 * EXPLORE, tokens=1024)  # NOTE: its own times, solo as well
    host.cost = {0: 0.008, 1: 0.002}  # NOTE: from here lending pays
    _run(arms, host, EXPLORE + 8, tokens=1024)
    solo, lent = arms.means_ms()[(1024).bit_length()]
    assert lent < solo
    ways = _run(arms, host, EXPLORE, tokens=200)
    assert ways == [1] * (EXPLORE - 1) + [0], "size 200 follows 1024 (nearer than 1): lent"
    ways = _run(arms, host, EXPLORE, tokens=2)
    assert ways == [0] * (EXPLORE - 1) + [1], "size 2 follows 1 (still timed solo faster)"
    solo, lent = arms.means_ms()[(200).bit_length()]
    assert lent < solo, "then timed apart: its own means"


def test_metrics_count_the_steps_each_way():
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from warmboot.server.metrics import _helper_families

    assert list(_helper_families({"helper_steps": None})) == []

    class _Collector:
        def collect(self):
            return _helper_families({"helper_steps": [40, 9]})

    registry = CollectorRegistry()
    registry.register(_Collector())
    text = generate_latest(registry).decode()
    assert 'warmboot_cpu_helper_steps_total{way="solo"} 40.0' in text
    assert 'warmboot_cpu_helper_steps_total{way="lent"} 9.0' in text
