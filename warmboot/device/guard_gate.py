"""Compiled steps without dynamo's guard checks, where that is safe.

A compiled step enters two graphs (``device.compiled``: the hidden rows, then the logits),
and each entry first runs dynamo's guards, whose cost grows with what the graph reads (every
layer's weights). An engine whose graphs were traced at ``warm_up`` for any row count, and
which no other engine shares (each engine has code objects of its own), runs its steps under
torch's ``skip_guard_eval_unsafe`` stance: with one cached graph per code object, nothing is
left to check. An engine whose graphs traced again for another row count keeps its guards:
the stance keeps only the guards that tell cached graphs apart, and not every kind of them
(measured, when each layer was a graph of its own: exaone4's layers with and without rope
were confused).

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
