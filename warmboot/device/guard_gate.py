"""Compiled steps without dynamo's guard checks, once every graph they need exists.

A compiled step calls the layer graph once per layer (``device.compiled``), and each call
first runs dynamo's guards for that graph: about 0.15-0.2 ms a call on these CPUs, 5-6 ms of
a 30-layer step, 15% of a batch-1 decode. After ``warm_up`` the graphs a model needs all
exist (the token count is symbolic; every layer, decode and prefill alike, reuses them), so
a warmed engine's steps run under torch's ``skip_guard_eval_unsafe`` stance, which checks only
the guards that tell one cached graph from another (one model's from another's).

The stance is process-wide, and what is unsafe about it is a compile running under it (it
would reuse a graph traced for another model instead of tracing its own). So the gate keeps
the two apart: a compile (``compiling``) waits for unguarded steps in flight to finish, and
while one runs, steps keep their guards (``unguarded`` then changes nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_COND = threading.Condition()
_state = {"compiling": 0, "unguarded": 0}


def needed_a_trace(error: RuntimeError) -> bool:
    """Whether ``error`` is torch refusing to trace under the stance (nothing ran)."""
    return "skip_guard_eval_unsafe" in str(error)


def skipping() -> bool:
    """Whether steps now run without guards."""
    with _COND:
        return _state["unguarded"] > 0


@contextmanager
def compiling() -> Iterator[None]:
    """Around anything that may trace: no step runs unguarded meanwhile."""
    with _COND:
        _state["compiling"] += 1
        _COND.wait_for(lambda: _state["unguarded"] == 0)
    try:
        yield
    finally:
        with _COND:
            _state["compiling"] -= 1
            _COND.notify_all()


@contextmanager
def unguarded() -> Iterator[None]:
    """Around a warmed engine's step: guards skipped unless a compile is in flight."""
    with _COND:
        skip = _state["compiling"] == 0
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
