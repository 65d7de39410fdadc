"""The CPU thread policy: how many torch compute threads the device thread runs, and where.

Measured on 2 cores (docs/benchmarks/contention.md): one compute thread pinned to its core,
leaving the other to the host loop (scheduling, detokenising, the server), decodes faster
than two at every batch size, and holds up when another process loads the machine: with two
threads every op's OpenMP barrier waits for whichever core the other process holds (10x
slower steps seen), with one the kernel scheduler shares the cores fairly. vLLM's CPU build
makes the same choice (one bound OpenMP thread, one core reserved).

The host's core is mostly idle between the host loop's bursts, though. The native kernels can
borrow it without that barrier (``CpuStream.lend_helpers``, ``kernels/native/csrc/pool.cpp``):
a helper thread on the host's core takes chunks of a kernel's work only while it runs, and
the device thread never waits for a chunk the helper has not started. Whether it pays is
measured at start (``device.step_choice``), then step by step as the host core's load comes
and goes (``device.helper_arms``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def default_threads(cpus: int) -> int:
    """All cores but one, which the host loop keeps; one on a single core."""
    return max(1, cpus - 1)


def compute_cpus(threads: int) -> list[int]:
    """The cores the compute threads are pinned to: the last ``threads`` usable ones (the
    host loop keeps the first)."""
    cpus = usable_cpus()
    return cpus[-threads:] if threads < len(cpus) else cpus


def host_cpus(threads: int) -> list[int]:
    """The usable cores the compute threads leave to the host loop."""
    compute = set(compute_cpus(threads))
    return [c for c in usable_cpus() if c not in compute]


def pin_this_thread(cpus: list[int]) -> bool:
    """Pin the calling thread (and the OpenMP workers it starts later) to ``cpus``; False
    where the OS refuses (some sandboxes)."""
    try:
        os.sched_setaffinity(0, cpus)  # NOTE: on Linux, pid 0 is the calling thread
    except (AttributeError, OSError):
        return False
    return True


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads on this thread (None: as it is), as the
    device thread runs: dynamo guards on the count, so a trace or a call made elsewhere with
    another count would recompile."""
    import torch

    caller = torch.get_num_threads()
    torch.set_num_threads(threads or caller)
    try:
        yield
    finally:
        torch.set_num_threads(caller)
