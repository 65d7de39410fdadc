"""The opaque op a LoRA-targeted ``Linear`` calls after its own GEMM:
``warmboot::lora_linear(y, x, index)`` adds the step's adapters' deltas to ``y``
(``kernels.lora.lora_add``) for linear ``index``. The step binds its stacks and row plan on the
thread that runs it (``bound_lora``), in eager and compiled steps alike; a compiled graph sees
only the op, so loading or swapping adapters never recompiles it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from warmboot.kernels.lora import LoraRows, LoraStack, lora_add


@dataclass
class LoraStep:
    """A step's LoRA state: per targeted linear its stack (None: no adapter has touched it
    yet), and which slot each row uses."""

    stacks: list[LoraStack | None]
    rows: LoraRows


_LOCAL = threading.local()


@contextmanager
def bound_lora(step: LoraStep | None) -> Iterator[None]:
    """Bind ``step`` for the ``lora_linear`` calls run on this thread."""
    previous = getattr(_LOCAL, "step", None)
    _LOCAL.step = step
    try:
        yield
    finally:
        _LOCAL.step = previous


def lora_apply(y: torch.Tensor, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``y`` plus linear ``index``'s adapter deltas for the bound step's rows; ``y`` itself
    when no row of the step uses an adapter on it (eager steps call this directly)."""
    step = getattr(_LOCAL, "step", None)
    if step is None or not step.rows.active:
        return y
    stack = step.stacks[int(index)]
    return y if stack is None else lora_add(y, x, stack, step.rows)


def lora_linear(y: torch.Tensor, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = lora_apply(y, x, index)
    return out.clone() if out is y else out  # NOTE: a functional op may not return an input


_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define("lora_linear(Tensor y, Tensor x, Tensor index) -> Tensor")
_LIB.impl("lora_linear", lora_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::lora_linear")
def _(y, x, index):
    return torch.empty_like(y)
