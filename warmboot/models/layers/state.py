"""State layers: the token mixers of hybrid models that keep a fixed-size state per request
instead of K/V per token (gated DeltaNet, Mamba 2, short convolutions), and the gated RMSNorm
several of them end with.

A ``StateMixer`` takes the place of a layer's attention: called as ``mixer(x, positions, step)``
like ``Attention``, it declares its ``kind`` and its per-request tensors (``state_specs``), which
the model's ``KVLayout`` lists and the runner allocates once per state slot; its recurrences run
through ``kernels.state_ops`` (the ops a compiled step keeps out of its graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels.backend import StateSpec


class StateMixer(nn.Module):
    kind: str = ""
    """The layer kind (``KVLayout.kinds``)."""

    def state_specs(self) -> tuple[StateSpec, ...]:
        raise NotImplementedError


class Conv1dWeight(nn.Module):
    """A depthwise ``nn.Conv1d``'s parameters as checkpoints store them: ``weight``
    (C, 1, K), optional ``bias`` (C,)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.kernel = kernel

    def spec(self) -> StateSpec:
        """The conv window a request keeps: its last ``K - 1`` inputs, in the model's dtype."""
        return StateSpec("conv", (self.weight.shape[0], self.kernel - 1))

    def taps(self) -> torch.Tensor:  # (C, K)
        return self.weight.squeeze(1)


QKV_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
"""A checkpoint's separate q, k and v convs (Kimi Linear, OLMo hybrid), in channel order."""


class JoinedConv1dWeight(Conv1dWeight):
    """Depthwise convs over consecutive channel groups (q, k, v) as one, without bias: the
    loader joins a checkpoint's per-group tensors (``QKV_CONVS``) along the channels."""

    def __init__(self, channels: int, kernel: int):
        super().__init__(channels, kernel, bias=False)

    def shard_count(self, leaf: str) -> int:
        return len(QKV_CONVS)

    def join_shards(self, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * silu(gate)`` scaled by ``weight``, in float32: the norm before the gate
    (Qwen3-Next's), or with ``gate_first`` the gate before the norm (Mamba 2's). ``group_size``:
    normalise groups of that many channels apart (Mamba 2's ``n_groups``); None: the last dim."""

    def __init__(
        self, size: int, eps: float, group_size: int | None = None, gate_first: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.group_size, self.gate_first = eps, group_size, gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        xf = x.float()
        if self.gate_first:
            xf = xf * F.silu(gate.float())
        if self.group_size is not None:
            xf = xf.view(*shape[:-1], -1, self.group_size)
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape)
        if self.gate_first:
            return self.weight * xf.to(dtype)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)
