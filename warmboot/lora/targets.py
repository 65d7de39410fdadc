"""A model's adaptable linears and its adapter slots on the device.

``LoraTargets`` numbers every ``Linear`` of the decoder layers (its ``lora_index`` buffer: what
``warmboot::lora_linear`` reads), maps an adapter's modules onto them through the model's own
checkpoint names (``CausalLM.map_name``: ``q_proj`` is shard 0 of ``qkv_proj``) and keeps the
adapters' weights in per-linear stacks of ``max_loras`` slots (``kernels.lora.LoraStack``),
made when an adapter first touches the linear. Slots go least recently used first, never one a
step's rows need."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from warmboot.kernels.lora import LoraStack, lora_rows
from warmboot.kernels.lora_op import LoraStep
from warmboot.lora.adapter import Adapter, LoraError
from warmboot.models.layers.linear import LORA_INDEX, Linear

Parts = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(frozen=True)
class Resolved:
    """An adapter laid out for the model: per targeted linear (by number), per shard its
    (A, B) or None."""

    name: str
    digest: str
    parts: dict[int, Parts]


class LoraTargets:
    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype, device):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.dtype, self.device = dtype, device
        linears = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, Linear) and name.startswith("layers.")
        ]
        self.index = {name: i for i, (name, _) in enumerate(linears)}
        self.linears = [m for _, m in linears]
        for i, m in enumerate(self.linears):
            if getattr(m, LORA_INDEX) is None:  # NOTE: a linear shared by layers keeps its first
                m.register_buffer(LORA_INDEX, torch.tensor(i), persistent=False)
        self.stacks: list[LoraStack | None] = [None] * len(linears)
        self.slots: OrderedDict[str, int] = OrderedDict()
        """Adapter name -> its slot, least recently used first."""

    def resolve(self, name: str, adapter: Adapter) -> Resolved:
        """``adapter``'s modules as parts of the model's linears; ``LoraError`` naming a
        module the model has no adaptable linear for, or a shape that does not fit."""
        if adapter.rank > self.max_rank:
            raise LoraError(
                f"adapter {name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}"
            )
        parts: dict[int, Parts] = {}
        for module, lora in adapter.modules.items():
            index, shard = self._target(name, module)
            linear = self.linears[index]
            out = linear.shards[shard]
            if lora.a.shape[1] != linear.in_features or lora.b.shape[0] != out:
                raise LoraError(
                    f"adapter {name!r}: {module} is {lora.a.shape[1]} -> {lora.b.shape[0]}, "
                    f"the model's is {linear.in_features} -> {out}"
                )
            per_shard = parts.setdefault(index, [None] * len(linear.shards))
            per_shard[shard] = (lora.a, lora.b)
        return Resolved(name, adapter.digest, parts)

    def _target(self, name: str, module: str) -> tuple[int, int]:
        mapped = self.model.map_name(f"{module}.weight")
        ours = mapped[0].removesuffix(".weight") if mapped else None
        if ours not in self.index:
            raise LoraError(f"adapter {name!r}: the model has no adaptable linear {module!r}")
        return self.index[ours], mapped[1] or 0

    def plan(
        self,
        rows: list[tuple[str | None, int]],
        adapters: Callable[[str], Resolved],
        upload: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[LoraStep, list[Resolved]]:
        """The step whose rows (decodes first) have these (adapter name, tokens): its slots
        taken (the adapters not resident to load, in the returned list) and its row plan."""
        names = {n for n, _ in rows if n is not None}
        loads = []
        for n in names:
            if n in self.slots:
                self.slots.move_to_end(n)
            else:
                loads.append(adapters(n))
                self.slots[n] = self._free_slot(names)
        base = self.max_loras
        slots = [self.slots[n] if n is not None else base for n, _ in rows]
        plan = lora_rows(slots, [t for _, t in rows], base, upload)
        return LoraStep(self.stacks, plan), loads

    def _free_slot(self, needed: set[str]) -> int:
        taken = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next(n for n in self.slots if n not in needed)  # NOTE: max_loras bounds a step
        return self.slots.pop(victim)

    def load(self, adapter: Resolved) -> None:
        """Write ``adapter`` into its slot (on the stream that runs the steps, so after the
        steps before it): its linears' parts, every other stack's slot zeroed."""
        slot = self.slots[adapter.name]
        for i, parts in adapter.parts.items():
            if self.stacks[i] is None:
                linear = self.linears[i]
                self.stacks[i] = LoraStack(
                    self.max_loras,
                    self.max_rank,
                    linear.in_features,
                    list(linear.shards),
                    self.dtype,
                    self.device,
                )
            self.stacks[i].load(slot, parts)
        for i, stack in enumerate(self.stacks):
            if stack is not None and i not in adapter.parts:
                stack.clear(slot)

    def forget(self, name: str) -> None:
        """An unloaded adapter's slot is free again (its weights stay until overwritten)."""
        self.slots.pop(name, None)
