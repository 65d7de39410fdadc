"""exp2_emulated (FMA-only exponential) against float64 torch, in Triton's interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels.exp2 import MAX_REL_ERR, exp2  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter
REL_BOUND = 1.5e-4


def test_relative_error_over_normal_range():
    x = torch.linspace(-125.5, 0.0, 100_003, dtype=torch.float32)
    ref = torch.exp2(x.double())
    rel = ((exp2(x).double() - ref).abs() / ref).max().item()
    assert rel <= MAX_REL_ERR <= REL_BOUND, f"max relative error {rel:.3e}"


def test_integers_exact_and_fractional_grid():
    x = torch.arange(-125, 1, dtype=torch.float32)
    assert torch.equal(exp2(x), torch.exp2(x))
    g = torch.Generator().manual_seed(7)
    y = -torch.rand(4096, generator=g) * 60
    rel = ((exp2(y).double() - torch.exp2(y.double())).abs() / torch.exp2(y.double())).max()
    assert rel <= REL_BOUND


def test_denormal_range_absolute_and_clamp_exact_zero():
    x = torch.linspace(-127.0, -125.5, 1001, dtype=torch.float32)
    err = (exp2(x).double() - torch.exp2(x.double())).abs().max().item()
    assert err < 2.0**-125
    below = torch.tensor([-127.0, -127.5, -200.0, -1e30, float("-inf")])
    out = exp2(below)
    assert torch.equal(out, torch.zeros_like(out)) and not out.signbit().any()


def test_hardware_path_matches():
    x = torch.linspace(-30, 0, 257, dtype=torch.float32)
    torch.testing.assert_close(exp2(x, emulated=False), torch.exp2(x), rtol=1e-6, atol=0)
