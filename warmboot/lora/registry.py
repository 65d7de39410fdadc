"""The adapters an engine knows (``LoRARequest``s by name) and the ones held in host memory:
at most ``max_cpu_loras`` resolved adapters, least recently used first; one evicted is read
from its path again when a request needs it. A step's plan takes their device slots
(``LoraTargets.plan``); ``step_lora`` loads what the plan needs and binds it while the step
runs, on the stream that runs the steps."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from warmboot.kernels.lora_op import LoraStep, bound_lora
from warmboot.lora.adapter import LoraError, load_adapter
from warmboot.lora.targets import LoraTargets, Resolved
from warmboot.lora_request import LoRARequest


@dataclass
class LoraPlan:
    """A step's adapters: the targets, its bound state, and the adapters to load first."""

    targets: LoraTargets
    step: LoraStep
    loads: list[Resolved]


class LoraRegistry:
    def __init__(self, targets: LoraTargets, max_cpu_loras: int):
        self.targets, self.max_cpu_loras = targets, max_cpu_loras
        self.known: dict[str, LoRARequest] = {}
        self.held: OrderedDict[str, Resolved] = OrderedDict()
        self.in_use: Callable[[], set[str]] = set
        """Adapters live requests use (the engine's scheduler): never evicted."""
        self._lock = threading.RLock()
        """The server adds adapters from its own threads; plans take slots on the engine's."""

    def add(self, request: LoRARequest) -> Resolved:
        """Know ``request``'s adapter (read and checked on first sight); ``LoraError`` naming
        what is wrong. A name already known must come with the same path."""
        with self._lock:
            known = self.known.get(request.lora_name)
            if known is not None and known.lora_path != request.lora_path:
                raise LoraError(
                    f"adapter {request.lora_name!r} is already loaded from {known.lora_path!r}, "
                    f"not {request.lora_path!r}: unload it first"
                )
            if known is None:  # NOTE: an unloaded adapter of this name: its weights go
                if request.lora_name in self.in_use():
                    raise LoraError(f"adapter {request.lora_name!r} still serves requests")
                self.held.pop(request.lora_name, None)
                self.targets.forget(request.lora_name)
            resolved = self._resolved(request)
            self.known[request.lora_name] = request
            return resolved

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (requests running with it keep their slot until they end)."""
        with self._lock:
            if self.known.pop(name, None) is None:
                raise KeyError(name)
            if name not in self.in_use():  # NOTE: else held until its requests end
                self.held.pop(name, None)
                self.targets.forget(name)

    def names(self) -> list[str]:
        return list(self.known)

    def resolved(self, name: str) -> Resolved:
        """Adapter ``name`` laid out (held, or read again); an unloaded one its requests
        still use stays held."""
        with self._lock:
            held = self.held.get(name)
            if held is not None:
                self.held.move_to_end(name)
                return held
            return self._resolved(self.known[name])

    def _resolved(self, request: LoRARequest) -> Resolved:
        name = request.lora_name
        if name in self.held:
            self.held.move_to_end(name)
            return self.held[name]
        if not request.lora_path:
            raise LoraError(f"adapter {name!r}: no lora_path to load it from")
        adapter = load_adapter(request.lora_path, self.targets.max_rank)
        resolved = self.targets.resolve(name, adapter)
        self.held[name] = resolved
        busy = self.in_use()
        for old in [n for n in self.held if n != name and n not in busy]:
            if len(self.held) <= self.max_cpu_loras:
                break
            del self.held[old]
        return resolved

    def plan(self, rows: list[tuple[str | None, int]]) -> LoraPlan | None:
        """A step's plan; None when no row uses an adapter and none needs loading."""
        if all(name is None for name, _ in rows):
            return None
        with self._lock:
            step, loads = self.targets.plan(rows, self.resolved, lambda t: t)
        return LoraPlan(self.targets, step, loads)


@contextmanager
def step_lora(
    plan: LoraPlan | None, upload: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Run a step's forward with its adapters loaded and bound (no-op without a plan)."""
    if plan is None:
        yield
        return
    for adapter in plan.loads:
        plan.targets.load(adapter)
    rows = plan.step.rows
    if rows.decode_slots is not None:
        rows.decode_slots = upload(rows.decode_slots)
    with bound_lora(plan.step):
        yield
