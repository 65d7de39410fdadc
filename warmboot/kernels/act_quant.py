"""Activation quantization as the formats' runtimes do it before an 8-bit GEMM, quantized and
dequantized here (the GEMM then reads float inputs that hold exactly the quantized values):
the numbers of a W8A8 or FP8 checkpoint are those of its quantized activations, so serving it
with full-precision inputs would give other tokens.

- ``ct`` (compressed-tensors' ``calculate_qparams`` and ``_quantize``): the range always
  holds 0; symmetric scale ``max(|min|, |max|) / ((qmax - qmin) / 2)`` (127.5 for int8, 448
  for e4m3), the dtype's eps where it is 0; int8: ``clamp(round(x / s), -128, 127)``, fp8:
  ``clamp(x / s, -448, 448)`` cast to e4m3; then times ``s``.
- ``kernel`` (the FP8 block kernels of DeepSeek-V3 and transformers): per row and group of
  inputs, ``s = amax / 448`` (``ue8m0``: rounded up to a power of two), ``x / s`` cast to e4m3.

W8A8 int8 (per token or static per tensor) on the native CPU kernel takes ``quantize_int8``'s
codes and scales instead: the GEMM sums the int8 products exactly (``warmboot_cpu::
quant_linear_i8``).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8 = (-128.0, 127.0)


def fake_quant(
    x: torch.Tensor,
    number: str,
    strategy: str,
    group_size: int | None = None,
    rule: str = "ct",
    ue8m0: bool = False,
    static_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` with each value replaced by its quantized-then-dequantized value."""
    q, scale = _quantized(x, number, strategy, group_size, rule, ue8m0, static_scale)
    return (q * scale).reshape(x.shape)


def quantize_int8(
    x: torch.Tensor, strategy: str, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fake_quant``'s int8 codes (``ct`` rule, per ``token`` or ``tensor``) as int8, with
    their float32 scales (one per row of ``x``'s last dimension, or one in all): ``fake_quant``
    is ``q * scale`` rounded to ``x``'s dtype, which an integer GEMM leaves unrounded."""
    if strategy not in ("token", "tensor"):
        raise ValueError(f"int8 codes per token or tensor, not per {strategy}")
    q, scale = _quantized(x, "int8", strategy, None, "ct", False, static_scale)
    return q.to(torch.int8), scale.float().reshape(-1)


def ct_codes(x: torch.Tensor, number: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s codes per row (``int8`` integers or ``fp8`` values, in ``x``'s dtype) and
    their scales by compressed-tensors' rule (its ``calculate_qparams``): what quantizing a
    weight per output channel at load takes too (``kernels.quant.quantize_rows``)."""
    return _quantized(x, number, "token", None, "ct", False, None)


def _quantized(x, number, strategy, group_size, rule, ue8m0, static_scale):
    """The codes (in ``x``'s dtype; by groups for ``group``) and the scales they take."""
    if strategy == "group":
        x = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    if static_scale is not None:
        scale = static_scale.to(x.dtype)
    elif rule == "kernel":
        scale = _kernel_scale(x, ue8m0)
    else:
        scale = _ct_scale(x, number, strategy)
    if number == "int8":
        return torch.clamp(torch.round(x / scale), *INT8), scale
    return torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype), scale


def _ct_scale(x: torch.Tensor, number: str, strategy: str) -> torch.Tensor:
    if strategy == "tensor":
        lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    else:
        lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    half_range = (INT8[1] - INT8[0]) / 2 if number == "int8" else FP8_MAX
    scale = torch.maximum(lo.abs(), hi.abs()) / half_range
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def _kernel_scale(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale
