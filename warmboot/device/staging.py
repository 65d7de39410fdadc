"""Host-side step inputs: the one host -> device upload helper, the two ping-pong working
sets a step's inputs are written into, and the handle that is a launched step's future."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from warmboot.core.types import ScheduledRequest, SchedulerOutput
from warmboot.device.pools import StateMoves
from warmboot.device.streams import Event
from warmboot.kernels.backend import AttentionMetadata
from warmboot.lora.registry import LoraPlan


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: non-blocking from pinned memory on
    CUDA (pageable tensors are pinned first: a copy from pageable memory waits for the
    stream); the tensor itself on the CPU. Call it inside the stream that uses the result."""
    if device.type != "cuda":
        return t
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def host_tensor(values, pin: bool) -> torch.Tensor:
    """A fresh int64 host tensor, pinned when ``pin`` (so its upload is asynchronous)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t.pin_memory() if pin else t


class Staging:
    """One ping-pong working set: preallocated host tensors (pinned on CUDA) that a step's
    inputs are written into and uploaded from. The runner reuses a set only after the step
    that last used it has been collected, so its uploads have completed."""

    ROWS = ("seq_lens", "sample_index", "fed_index", "fed_slots", "sample_slots", "state_slots")
    TOKENS = ("ids", "positions", "slots")

    def __init__(self, max_tokens: int, max_rows: int, width: int, pin: bool):
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, pin_memory=pin)

        self._bufs = {name: buf(max_tokens) for name in self.TOKENS}
        self._bufs |= {name: buf(max_rows) for name in self.ROWS}
        self._tables = buf(max_rows * width)
        self._pin = pin

    def put(self, name: str, values: list[int]) -> torch.Tensor:
        """``values`` as a view of the named buffer (a fresh tensor if they do not fit)."""
        buf = self._bufs[name]
        if len(values) > buf.shape[0]:  # NOTE: not expected: the scheduler bounds a step
            return host_tensor(values, self._pin)
        view = buf[: len(values)]
        view.numpy()[:] = values
        return view

    def tables(self, source: np.ndarray, rows: list[int], width: int) -> torch.Tensor:
        """(len(rows), width) view holding ``source[rows, :width]``, copied in C."""
        n = len(rows)
        if n * width > self._tables.shape[0]:
            return host_tensor(source[rows, :width], self._pin)
        view = self._tables[: n * width].view(n, width)
        np.take(source[:, :width], rows, axis=0, out=view.numpy())
        return view

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of one of this set's buffers."""
        ptr = t.untyped_storage().data_ptr()
        buffers = [*self._bufs.values(), self._tables]
        return any(b.untyped_storage().data_ptr() == ptr for b in buffers)


@dataclass
class StepInputs:
    """Host-built tensors of one step (rows ordered decodes first)."""

    rows: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[ScheduledRequest]
    sample_index: torch.Tensor
    """(num_sampling_rows,) index of each sampling row's last token in the batch."""
    last_index: list[int]
    """Per row: index of its last token in the batch."""
    graph_batch: int | None = None
    """Decode-only step run as a CUDA graph: rows padded to this captured batch size."""
    prompt_rows: list[tuple[str, int, int]] = field(default_factory=list)
    """Rows that want prompt logprobs: (request id, how many, top-k)."""
    prompt_index: torch.Tensor | None = None
    """Batch positions whose next-token logprobs those rows want, rows in order."""
    prompt_targets: torch.Tensor | None = None
    """The prompt tokens those positions predict."""
    state_moves: StateMoves = field(default_factory=StateMoves)
    """State rows zeroed or loaded before the forward and kept after it."""
    lora: LoraPlan | None = None
    """The step's adapters (``lora.registry``): loaded and bound around its forward."""


@dataclass
class StepHandle:
    """One launched step: a future for its sampled tokens."""

    sched: SchedulerOutput
    buffer: int
    """Ping-pong working set (step number mod 2)."""
    inputs: StepInputs | None = None
    logits: torch.Tensor | None = None
    result: object | None = None
    """The sampler's output as host tensors, valid once ``event`` has completed."""
    prompt_result: object | None = None
    """Prompt logprobs as host tensors, valid then too."""
    event: Event | None = None
    collected: bool = False
    held_seqs: list[str] = field(default_factory=list)
    """Sequences whose KV blocks this step references; held until it retires."""

    @property
    def sample_rows(self) -> list[ScheduledRequest]:
        return self.inputs.sample_rows if self.inputs is not None else []
