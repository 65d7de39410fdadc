"""exp2 on the FMA units (FlashAttention-4's software exponential), as a Triton device function.

``2^x = 2^n * 2^f`` with ``n = round(x)`` and ``f = x - n`` in [-0.5, 0.5]:

- range reduction: ``j = x + 1.5 * 2^23`` rounds to nearest and leaves ``n`` in the low
  mantissa bits of ``j``; ``n = j - 1.5 * 2^23`` recovers it as a float (two FADDs);
- ``2^f`` by a degree-3 polynomial (3 FMAs), coefficients below;
- ``2^n`` by adding ``bits(j) << 23`` (= ``n << 23`` modulo 2^32) to the polynomial's bit
  pattern: one integer shift-add (LEA), no float->int conversion (no F2I/FRND/MUFU).

Coefficients: minimax *relative* error fit of ``2^f`` on [-0.5, 0.5] with the constant term
pinned to 1 (Lawson's iteratively reweighted least squares in float64 on 20001 points, then
rounded to fp32). Max relative error of the fp32 evaluation: 1.01e-4 (13.3 bits), enough for
fp16/bf16 P. NOTE: ``p(0) == 1`` exactly, so integers are exact and the clamp gives 0.0
(a constant below 1 would wrap the exponent into a NaN there).

Range: ``x`` is clamped at -127, where the assembled bits are exactly 0.0, so every
``x <= -127`` (and -inf) gives exactly 0. Below about x = -125.5 the result's exponent field
reaches 0 (fp32 denormals), which the exponent add cannot represent: there the error is
absolute (< 2^-125), as for the hardware ``ex2.approx.ftz`` that flushes denormals to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAGIC = 12582912.0  # 1.5 * 2^23
C1 = 0.6932829022407532
C2 = 0.2422109991312027
C3 = 0.05500893294811249
MAX_REL_ERR = 1.02e-4
"""Measured max relative error of the polynomial over [-0.5, 0.5] (fp32 evaluation)."""


@triton.jit
def exp2_emulated(x):
    """2^x for fp32 ``x`` without the special-function unit (see the module docstring)."""
    x = tl.maximum(x, -127.0)
    j = x + 12582912.0  # round to nearest: n sits in the low mantissa bits of j
    f = x - (j - 12582912.0)  # in [-0.5, 0.5]
    p = tl.fma(f, 0.05500893294811249, 0.2422109991312027)
    p = tl.fma(p, f, 0.6932829022407532)
    p = tl.fma(p, f, 1.0)
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_kernel(X, Y, n, EMULATED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    if EMULATED:
        y = exp2_emulated(x)
    else:
        y = tl.exp2(x)
    tl.store(Y + offs, y, mask=mask)


def exp2(x: torch.Tensor, emulated: bool = True, block: int = 1024) -> torch.Tensor:
    """Elementwise 2^x of a contiguous fp32 tensor through the Triton kernel (for tests)."""
    if x.dtype != torch.float32:
        raise TypeError(f"exp2 expects float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("exp2 expects a contiguous tensor")
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _exp2_kernel[(triton.cdiv(n, block),)](x, y, n, EMULATED=emulated, BLOCK=block)
    return y
