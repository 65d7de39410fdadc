"""LoRA over a step's rows: several adapters, and the base, in one batch (issue 57).

Each LoRA-targeted linear keeps its adapters' weights in fixed stacks (``LoraStack``), one
slot an adapter and a last slot of zeros for the base, allocated once: loading an adapter
writes into a slot, so nothing recompiles. A packed linear (q/k/v, gate/up) keeps shard i's A
rows in its own block of the rank axis, so one shrink covers every shard; each shard's B is
a stack of its own, one expand GEMM a shard (a block-diagonal B would save those calls but
read its zero blocks: slower at decode but for small bf16 q/k/v on the CPU, where a GEMM
call's fixed cost dominates; ``bench/lora_op.py`` has the figures).

Per step a ``LoraRows`` plan, built on the host (``lora_rows``), says which slot each row
uses; ``lora_add`` adds ``(x_t @ A_s.T) @ B_s.T`` to each row ``t`` of slot ``s``:

- decode rows (the step's leading one-token rows): over the window of slots they use, one
  shrink over all those slots' A, the rows' own slot kept by a one-hot mask, one expand a
  shard over those slots' B (cost grows with the window, not with the rows); a window wider
  than ``DENSE_SPAN`` times the rows gathers each row's A and B instead (punica's BGMV: cost
  grows with the rows). Both read only device tensors of fixed shapes, no host sync;
- prefill segments (contiguous rows of one slot): a shrink and an expand a shard each
  (SGMV-like); segments of the base are skipped.

On the CPU (float32, bf16) the decode rows take one native call a linear instead
(``native/csrc/lora.cpp``: every row and shard, reading only the A and B rows an adapter
fills, per ``LoraStack.ranks``): torch's form costs a few small GEMM calls a linear, each
~20-25 us at bf16 on the CPU whatever its size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from warmboot.kernels import native

DENSE_SPAN = 3
"""Decode rows take the masked dense form while their slot window spans at most this many
slots a row; past it, the gathered form (BGMV). ``bench/lora_op.py`` measures both."""
NATIVE = True
"""CPU decode rows by the native op where the library is loaded (False: torch's forms, as
on other devices; tests and ``bench/lora_op.py`` compare them)."""


@dataclass
class LoraRows:
    """Which adapter slot each of a step's rows uses."""

    decode_slots: torch.Tensor | None
    """(D,) int64 on the device: the slot of each leading one-token row; None when there are
    no decode rows or none uses an adapter."""
    segments: list[tuple[int, int, int]]
    """(start, length, slot) of the prefill rows that use an adapter."""
    active: bool
    """Whether any row uses an adapter; if not, ``lora_add`` returns y itself."""
    window: tuple[int, int] | None = None
    """Slots [lo, hi) the decode rows' adapters lie in; None: every adapter slot (a plan
    whose decode work must not depend on host data, as a captured CUDA graph's)."""
    _masks: dict = field(default_factory=dict, repr=False, compare=False)


INACTIVE = LoraRows(None, [], False)


def lora_rows(
    row_slots: list[int | None],
    row_tokens: list[int],
    base_slot: int,
    upload: Callable[[torch.Tensor], torch.Tensor],
) -> LoraRows:
    """The plan of a step whose rows (decodes first) have these slots and token counts; a
    slot of None or below 0 is the base (``base_slot``). ``upload`` moves a host tensor to
    the device."""
    slots = [base_slot if s is None or s < 0 else s for s in row_slots]
    if all(s == base_slot for s in slots):
        return INACTIVE
    d = 0
    while d < len(row_tokens) and row_tokens[d] == 1:
        d += 1
    used = [s for s in slots[:d] if s != base_slot]
    decode = upload(torch.tensor(slots[:d], dtype=torch.int64)) if used else None
    window = (min(used), max(used) + 1) if used else None
    segments: list[tuple[int, int, int]] = []
    start = d
    for slot, n in zip(slots[d:], row_tokens[d:], strict=True):
        if slot != base_slot and n:
            if segments and segments[-1][2] == slot and sum(segments[-1][:2]) == start:
                segments[-1] = (segments[-1][0], segments[-1][1] + n, slot)
            else:
                segments.append((start, n, slot))
        start += n
    return LoraRows(decode, segments, True, window)


class LoraStack:
    """One linear's adapter slots: ``a`` (S + 1, R, in), R = len(shards) * max_rank, shard i's
    A in rows [i * max_rank, i * max_rank + r_i); ``bs[i]`` (S + 1, max_rank, out_i), shard
    i's B transposed. Slot S (``base_slot``) stays all zeros. ``ranks`` (S + 1, shards)
    int32, on the host: the rows of each shard's block a slot's adapter fills (the native
    decode reads no others); ``max_rank`` until a slot is first loaded or cleared."""

    def __init__(
        self,
        slots: int,
        max_rank: int,
        in_features: int,
        shards: list[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shards = list(shards)
        self.max_rank = max_rank
        kw = {"dtype": dtype, "device": device}
        self.a = torch.zeros(slots + 1, len(shards) * max_rank, in_features, **kw)
        self.bs = [torch.zeros(slots + 1, max_rank, out, **kw) for out in shards]
        self.ranks = torch.full((slots + 1, len(shards)), max_rank, dtype=torch.int32)
        self.ranks[slots] = 0

    @property
    def base_slot(self) -> int:
        return self.a.shape[0] - 1

    @property
    def b(self) -> torch.Tensor:
        """(S + 1, out, R): the shards' B block-diagonally (a copy, to inspect)."""
        b = self.a.new_zeros(self.a.shape[0], sum(self.shards), self.a.shape[1])
        row, mr = 0, self.max_rank
        for i, (out, bt) in enumerate(zip(self.shards, self.bs, strict=True)):
            b[:, row : row + out, i * mr : (i + 1) * mr] = bt.transpose(1, 2)
            row += out
        return b

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write an adapter into ``slot``: per shard ``(a_i (r_i, in), b_i (out_i, r_i))``, or
        None where the adapter leaves that shard alone. The rest of the slot is zeroed."""
        if not 0 <= slot < self.base_slot:
            raise ValueError(f"slot {slot} is not one of the {self.base_slot} adapter slots")
        if len(parts) != len(self.shards):
            raise ValueError(f"{len(parts)} parts for {len(self.shards)} shards")
        for i, (out, part) in enumerate(zip(self.shards, parts, strict=True)):
            a_i, b_i = part or (torch.zeros(0, self.a.shape[2]), torch.zeros(out, 0))
            r = a_i.shape[0]
            if r > self.max_rank or a_i.shape != (r, self.a.shape[2]) or b_i.shape != (out, r):
                raise ValueError(
                    f"shard {i}: A {tuple(a_i.shape)}, B {tuple(b_i.shape)} do not fit "
                    f"in {self.a.shape[2]} -> {out} at rank <= {self.max_rank}"
                )
        self.clear(slot)
        for i, part in enumerate(parts):
            if part is not None:
                a_i, b_i = part
                lo, r = i * self.max_rank, a_i.shape[0]
                self.a[slot, lo : lo + r].copy_(a_i)
                self.bs[i][slot, :r].copy_(b_i.T)
                self.ranks[slot, i] = r

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for bt in self.bs:
            bt[slot].zero_()
        self.ranks[slot] = 0


def lora_add(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows) -> torch.Tensor:
    """``y`` (N, out) plus each row's adapter delta for ``x`` (N, in); ``y`` itself when no
    row uses an adapter. Rows past the plan's (padding) are left as they are."""
    if not rows.active:
        return y
    d = 0 if rows.decode_slots is None else rows.decode_slots.shape[0]
    if d and uses_native(y, x, stack):
        out = torch.ops.warmboot_cpu.lora_decode(
            y, x, stack.a, stack.bs, stack.ranks, rows.decode_slots
        )
        if not rows.segments:
            return out
    elif d and d == y.shape[0] and not rows.segments:
        return _decode(y, x, stack, rows)
    else:
        out = y.clone()
        if d:
            out[:d] = _decode(y[:d], x[:d], stack, rows)
    mr = stack.max_rank
    for start, n, slot in rows.segments:
        if slot != stack.base_slot:
            rows_ = slice(start, start + n)
            h = (x[rows_] @ stack.a[slot].T).view(n, 1, -1, mr)
            out[rows_] = _expand(y[rows_], h, stack, slot, slot + 1, None)
    return out


def uses_native(y: torch.Tensor, x: torch.Tensor, stack: LoraStack) -> bool:
    """Whether the native op takes these decode rows: CPU, float32 or bf16, the library
    loaded (``native.ready``: never waits for a build)."""
    if not NATIVE or x.device.type != "cpu" or x.dim() != 2:
        return False
    if not x.dtype == y.dtype == stack.a.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if _NATIVE_OP.get("lora_decode") is None:
        if not native.ready():
            return False
        _NATIVE_OP["lora_decode"] = hasattr(torch.ops.warmboot_cpu, "lora_decode")
    return _NATIVE_OP["lora_decode"]


_NATIVE_OP: dict[str, bool] = {}


def _decode(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows) -> torch.Tensor:
    slots = rows.decode_slots
    d, mr = slots.shape[0], stack.max_rank
    lo, hi = rows.window or (0, stack.base_slot)
    if hi - lo <= DENSE_SPAN * d:
        a = stack.a[lo:hi].reshape(-1, stack.a.shape[2])
        h = (x @ a.T).view(d, hi - lo, -1, mr)
        return _expand(y, h, stack, lo, hi, _mask(rows, stack, x.dtype))
    h = torch.bmm(stack.a.index_select(0, slots), x.unsqueeze(2)).view(d, -1, 1, mr)
    outs, col = [], 0
    for i, (n, bt) in enumerate(zip(stack.shards, stack.bs, strict=True)):
        ys = y[:, col : col + n].unsqueeze(1)
        outs.append(torch.baddbmm(ys, h[:, i], bt.index_select(0, slots)).squeeze(1))
        col += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _expand(
    y: torch.Tensor,
    h: torch.Tensor,
    stack: LoraStack,
    lo: int,
    hi: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``y`` (M, out) plus, per shard i, ``h[:, :, i]`` (M, hi - lo, max_rank) (times
    ``mask``) over slots ``lo..hi - 1``'s B."""
    outs, col, m = [], 0, h.shape[0]
    for i, (n, bt) in enumerate(zip(stack.shards, stack.bs, strict=True)):
        hs = h[:, :, i] if mask is None else h[:, :, i] * mask
        outs.append(torch.addmm(y[:, col : col + n], hs.reshape(m, -1), bt[lo:hi].reshape(-1, n)))
        col += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _mask(rows: LoraRows, stack: LoraStack, dtype: torch.dtype) -> torch.Tensor:
    """(D, hi - lo, 1): 1 where a decode row's slot is that slot of the window; made once a
    plan, on the device, from ``decode_slots``."""
    lo, hi = rows.window or (0, stack.base_slot)
    key = (lo, hi, dtype)
    if key not in rows._masks:
        window = torch.arange(lo, hi, device=rows.decode_slots.device)
        rows._masks[key] = (rows.decode_slots[:, None, None] == window[:, None]).to(dtype)
    return rows._masks[key]
