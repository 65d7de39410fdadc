"""The state layers' decode steps as fused kernels: native code on the CPU
(``native/csrc/state_step.cpp``, the conv's in ``conv_step.cpp``), Triton on CUDA
(``kernels.triton_state``). Each updates the state rows of its slots in place, so the decode
rows skip the gather into a batch and the scatter back, and each head's state is read and
written once (torch's step made six passes over it). Each function returns the step's output,
or None where no kernel takes the tensors (library not loaded, another dtype or layout, a head
dim past the Triton kernels' 256): the caller then runs the torch step of
``kernels.recurrent``.

``ENABLED`` (``$WARMBOOT_STATE_KERNELS``, default on) switches them alone, for A/B runs;
``$WARMBOOT_NATIVE=0`` turns every native kernel off.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from warmboot.kernels import native

ENABLED = os.environ.get("WARMBOOT_STATE_KERNELS", "1") not in ("", "0")
_CONV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_cuda(states: Tensor) -> bool:
    return ENABLED and states.device.type == "cuda"


def _triton(name: str, *args) -> Tensor | None:
    """``kernels.triton_state``'s kernel ``name`` (imported on first use: CPU processes never
    load Triton), or None where its checks decline the tensors."""
    from warmboot.kernels import triton_state

    try:
        return getattr(triton_state, name)(*args)
    except ValueError:
        return None


def _takes(states: Tensor, slots: Tensor, *tensors: Tensor | None) -> bool:
    return (
        ENABLED
        and states.device.type == "cpu"
        and states.is_contiguous()
        and slots.dtype == torch.int64
        and all(t is None or t.device.type == "cpu" for t in (slots, *tensors))
        and native.ready()
    )


def _delta_takes(states: Tensor, slots: Tensor, q: Tensor, k: Tensor, v: Tensor, g, beta):
    return (
        states.dtype == torch.float32 and q.dim() == 3 and _takes(states, slots, q, k, v, g, beta)
    )


def gated_delta_step(states, slots, q, k, v, g, beta, scale: float) -> Tensor | None:
    """``recurrent.recurrent_gated_delta_step`` on ``states[slots]`` in place."""
    if _on_cuda(states):
        return _triton("gated_delta_decode", states, slots, q, k, v, g, beta, scale)
    if not _delta_takes(states, slots, q, k, v, g, beta):
        return None
    return torch.ops.warmboot_cpu.gated_delta_step(q, k, v, g, beta, states, slots, scale)


def kda_step(states, slots, q, k, v, g, beta, scale: float) -> Tensor | None:
    """``recurrent.recurrent_kda_step`` on ``states[slots]`` in place."""
    if _on_cuda(states):
        return _triton("kda_decode", states, slots, q, k, v, g, beta, scale)
    if not _delta_takes(states, slots, q, k, v, g, beta):
        return None
    return torch.ops.warmboot_cpu.kda_step(q, k, v, g, beta, states, slots, scale)


def ssd_step(states, slots, x, dt, A, B, C, D) -> Tensor | None:
    """``recurrent.ssd_step`` on ``states[slots]`` in place."""
    if _on_cuda(states):
        return _triton("ssd_decode", states, slots, x, dt, A, B, C, D)
    if (
        states.dtype != torch.float32
        or x.dim() != 3
        or not _takes(states, slots, x, dt, A, B, C, D)
    ):
        return None
    return torch.ops.warmboot_cpu.ssd_step(x, dt, A, B, C, D, states, slots)


def conv_step(states, slots, x, weight, bias, activation: str | None) -> Tensor | None:
    """``recurrent.causal_conv1d_step`` on ``states[slots]`` in place: x, weight, bias and the
    window in one dtype, x's rows contiguous."""
    if _on_cuda(states):
        return _triton("conv_decode", states, slots, x, weight, bias, activation)
    if (
        activation not in (None, "silu", "swish")
        or x.dtype not in _CONV_DTYPES
        or not (states.dtype == weight.dtype == x.dtype)
        or (bias is not None and bias.dtype != x.dtype)
        or x.dim() != 2
        or x.stride(-1) != 1
        or not _takes(states, slots, x, weight, bias)
    ):
        return None
    silu = activation is not None
    bias = None if bias is None else bias.contiguous()
    return torch.ops.warmboot_cpu.conv_step(x, weight.contiguous(), bias, states, slots, silu)
