"""Compiled steps without dynamo's guard checks, where that is safe.

A compiled step calls the layer graph once per layer (``device.compiled``), and each call
first runs dynamo's guards for that graph: about 0.15-0.2 ms a call on these CPUs, 5-6 ms of
a 30-layer step, 15% of a batch-1 decode. An engine whose every layer runs one graph, traced
at ``warm_up`` for any row count, and whose graphs no other engine shares (each engine has
code objects of its own), runs its steps under torch's ``skip_guard_eval_unsafe`` stance:
with one cached graph per code object, nothing is left to check. Engines with several layer
graphs (a model whose layers differ in structure) keep their guards: the stance keeps only
the guards that tell cached graphs apart, and not every kind of them (measured: exaone4's
layers with and without rope were confused).

The stance is process-wide, so the gate keeps guarded calls (a compile, a step of an engine
that keeps its guards) and unguarded steps apart: a guarded call waits for unguarded steps
in flight, and while one runs, steps keep their guards (``unguarded`` changes nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_COND = threading.Condition()
_state = {"guarded": 0, "unguarded": 0}


def needed_a_trace(error: RuntimeError) -> bool:
    """Whether ``error`` is torch refusing to trace under the stance (nothing ran)."""
    return "skip_guard_eval_unsafe" in str(error)


def skipping() -> bool:
    """Whether steps now run without guards."""
    with _COND:
        return _state["unguarded"] > 0


@contextmanager
def guarded() -> Iterator[None]:
    """Around anything that must keep its guards (a compile, a step of an engine whose
    graphs are not guard-free): no step runs unguarded meanwhile."""
    with _COND:
        _state["guarded"] += 1
        _COND.wait_for(lambda: _state["unguarded"] == 0)
    try:
        yield
    finally:
        with _COND:
            _state["guarded"] -= 1
            _COND.notify_all()


@contextmanager
def unguarded() -> Iterator[None]:
    """Around a guard-free engine's step: guards skipped unless a guarded call is in
    flight."""
    with _COND:
        skip = _state["guarded"] == 0
        if skip:
            _state["unguarded"] += 1
            if _state["unguarded"] == 1:
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    try:
        yield
    finally:
        if skip:
            with _COND:
                _state["unguarded"] -= 1
                if _state["unguarded"] == 0:
                    torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)
                    _COND.notify_all()
