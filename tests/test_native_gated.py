"""The gated MLP's fused activation (``kernels/native/csrc/gated.cpp``): ``silu_mul`` against
float64, ``dense_gated`` against ``silu_mul`` of torch's GEMM, and the ``packed_gated`` op of
a compiled step.

Bound: float32 arithmetic with an exp of about 1 ulp, then one rounding to the output's
dtype: bfloat16 2^-8 and float16 2^-10 of the value (plus float32's few ulps), float32 a few
ulps (1e-6 relative); below the normal range, half the dtype's smallest subnormal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import lent_a_helper
from warmboot.kernels import native

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

TOL = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 1e-6}
TINY = {torch.bfloat16: 2**-134, torch.float16: 2**-25, torch.float32: 2**-150}
"""Half the smallest subnormal: the rounding of a result below the normal range."""


def _gate_up(rows: int, width: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)


def _check(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    err = (out.double() - ref).abs()
    bound = ref.abs() * TOL[out.dtype] + TINY[out.dtype]
    assert out.dtype == gate_up.dtype and (err <= bound).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("isa", ["portable", "avx512_bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (5, 16), (2, 1536), (70, 33)])
def test_silu_mul_is_within_one_rounding_of_float64(isa, dtype, rows, width):
    best = native.isa()
    if isa != "portable" and best != isa:
        pytest.skip(f"this CPU cannot run {isa}")
    torch.ops.warmboot_cpu.use_isa(isa)
    try:
        gate_up = _gate_up(rows, width, dtype, seed=rows)
        _check(torch.ops.warmboot_cpu.silu_mul(gate_up), gate_up)
    finally:
        torch.ops.warmboot_cpu.use_isa(best)


def test_silu_mul_takes_leading_dims_extremes_and_refuses_an_odd_width():
    gate_up = torch.tensor([[-100.0, 100.0, 0.0, 3.0, 2.0, 1.0]]).to(torch.bfloat16)
    out = torch.ops.warmboot_cpu.silu_mul(gate_up.view(1, 1, 6))
    assert out.shape == (1, 1, 3)
    assert out.flatten().tolist() == [-0.0, 200.0, 0.0]  # NOTE: silu(-100) * 3, 100 * 2, 0
    with pytest.raises(RuntimeError, match="side by side"):
        torch.ops.warmboot_cpu.silu_mul(torch.zeros(2, 5))


def test_dense_gated_is_silu_mul_of_the_gemm_bit_for_bit_lent_a_helper_or_not():
    """Row blocks from 512 rows (``csrc/dense.h``), one GEMM below: the same bits as
    activating torch's GEMM of all rows, whichever thread takes a block."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2 * 96, 64, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(2 * 96, generator=g).to(torch.bfloat16)
    for rows in (7, 511, 1300):
        x = _gate_up(rows, 32, torch.bfloat16, seed=rows)
        want = torch.ops.warmboot_cpu.silu_mul(F.linear(x, w, b))
        assert torch.equal(torch.ops.warmboot_cpu.dense_gated(x, w, b), want)

    def round_() -> None:
        assert torch.equal(torch.ops.warmboot_cpu.dense_gated(x, w, b), want)

    lent_a_helper(round_)
    _check(want, F.linear(x, w, b))


def test_packed_gated_activates_the_packed_gemm_then_the_dense_one():
    from torch import nn

    from warmboot.kernels.step_ops import (
        PackedLinears,
        StepContext,
        bound,
        native_silu,
        packed_gated,
        packed_gemm,
    )

    lin = nn.Linear(64, 2 * 40, dtype=torch.bfloat16)
    table = PackedLinears()
    table.add_layer([lin])
    table.set_dense_rows(600)
    x = _gate_up(700, 32, torch.bfloat16, seed=2)
    zero = torch.tensor(0)
    with bound(StepContext(None, [], None, [], table)), torch.inference_mode():
        few, many = packed_gated(x[:5], zero, 0, 80), packed_gated(x, zero, 0, 80)
        packed = packed_gemm(x[:5], table.layers[0][0][0], lin.bias, 80)
        assert torch.equal(few, torch.ops.warmboot_cpu.silu_mul(packed))
        want = torch.ops.warmboot_cpu.dense_gated(x, lin.weight, lin.bias)
        assert torch.equal(many, want)
    assert few.shape == (5, 40) and many.shape == (700, 40)
    assert not native_silu(torch.float32)
    assert native_silu(torch.bfloat16) == (native.isa() == "avx512_bf16")
