"""W8A8 int8 in integers (``warmboot_cpu::quant_linear_i8``, ``kernels/native/csrc/
quant_gemm.cpp``): int8 rows against symmetric 8-bit codes in "panel32" panels, in every
instruction set this CPU can run (AVX-512 VNNI, AVX2, portable), against a float64 reference of
the same integer formula; ``act_quant.quantize_int8`` against ``fake_quant``; the layer's choice
of path; bad input refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import lent_a_helper
from warmboot.kernels import native, quant
from warmboot.kernels.act_quant import fake_quant, quantize_int8
from warmboot.models.layers.quant_linear import QuantMethod
from warmboot.models.quant_config import ActQuant, QuantScheme

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

OPS = torch.ops.warmboot_cpu


def _operands(m, n, k, seed, sdt=torch.float32):
    """int8 rows (full range), codes (n, k), their packed panels and per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, 1, generator=g) * 0.02 + 1e-3).to(sdt)
    xs = torch.rand(m, generator=g) * 0.1 + 1e-3
    return xq, xs, codes, OPS.quant_pack(codes, 8), quant.pack_groups(scales), scales


def _reference(xq, xs, codes, scales, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 xs * s * (xq . (u - 128)) + b (the sums exact: below 2^53), and its scaled
    sums' magnitude."""
    prod = xs.double().view(-1, 1) * scales.double().view(1, -1)
    scaled = prod * (xq.double() @ (codes.double() - 128).T)
    return scaled + (0 if bias is None else bias.double()), scaled.abs()


# (rows, out_features, in_features): K not a multiple of 64 (nor 4), N not of 32, rows 1..70
SHAPES = [(1, 33, 37), (2, 5, 3), (3, 100, 130), (8, 64, 256), (9, 70, 577), (17, 40, 66)]
SHAPES += [(31, 97, 129), (64, 33, 96), (70, 65, 201)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_integer_formula(isa, dtype):
    """y = fl(fl(float(sum) * fl(xs * s)) + b): three fp32 roundings of the scaled sum, one of
    the bias's sum (bf16 output: one bf16 rounding more, 2^-8 allowed)."""
    sdts = [torch.float32, torch.bfloat16, torch.float16]
    for i, (m, n, k) in enumerate(SHAPES):
        xq, xs, codes, packed, scales, flat = _operands(m, n, k, seed=i, sdt=sdts[i % 3])
        if i % 4 == 3:
            xs = xs[:1]  # NOTE: one scale for every row (static per tensor)
        bias = torch.randn(n).to(dtype if i % 3 else torch.float32) if i % 2 else None
        y = OPS.quant_linear_i8(xq, xs, packed, scales, bias, n, dtype)
        assert y.dtype == dtype and y.shape == (m, n)
        ref, scaled = _reference(xq, xs.expand(m), codes, flat, bias)
        tol = 4 * 2.0**-24 * scaled + 2.0**-24 * ref.abs() + 1e-30
        if dtype == torch.bfloat16:
            tol = tol + 2.0**-8 * ref.abs()
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), f"{(m, n, k)}: worst error / bound {(err / tol).max():.3g}"


def test_the_sums_are_exact(isa):
    """Unit scales and sums below 2^24: each output is the integer sum itself, bit for bit
    (an fp32 accumulation of K products of up to 2^14 would round)."""
    xq, _, codes, packed, _, _ = _operands(12, 70, 1023, seed=5)
    xq[0] = -128  # NOTE: the extremes: -128 against codes 0 and 255
    codes[:3] = torch.tensor([0, 255, 128], dtype=torch.uint8).view(3, 1)
    packed = OPS.quant_pack(codes, 8)
    ones = quant.pack_groups(torch.ones(70, 1))
    y = OPS.quant_linear_i8(xq, torch.ones(1), packed, ones, None, 70, torch.float32)
    want = xq.long() @ (codes.long() - 128).T
    assert want.abs().max() < 2**24 and want.abs().max() > 2**20
    assert torch.equal(y.double(), want.double())


def test_leading_dimensions_and_empty_rows():
    xq, xs, codes, packed, scales, flat = _operands(6, 40, 64, seed=3)
    y = OPS.quant_linear_i8(xq.view(2, 3, 64), xs, packed, scales, None, 40, torch.float32)
    assert y.shape == (2, 3, 40)
    assert torch.equal(
        y.view(6, 40), OPS.quant_linear_i8(xq, xs, packed, scales, None, 40, y.dtype)
    )
    empty = OPS.quant_linear_i8(xq[:0], xs[:0], packed, scales, None, 40, torch.bfloat16)
    assert empty.shape == (0, 40) and empty.dtype == torch.bfloat16
    meta = OPS.quant_linear_i8(
        xq.view(2, 3, 64).to("meta"),
        xs.to("meta"),
        packed.to("meta"),
        scales.to("meta"),
        None,
        40,
        torch.bfloat16,
    )
    assert meta.shape == (2, 3, 40) and meta.dtype == torch.bfloat16


def test_threads_and_a_helper_change_no_bit():
    xq, xs, _, packed, scales, _ = _operands(20, 3000, 576, seed=4)
    calls = [(xq[:1], xs[:1]), (xq, xs)]

    def run(x, s):
        return OPS.quant_linear_i8(x, s, packed, scales, None, 3000, torch.bfloat16)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    alone = [run(*c) for c in calls]
    torch.set_num_threads(2)
    try:
        assert all(torch.equal(run(*c), a) for c, a in zip(calls, alone, strict=True))
    finally:
        torch.set_num_threads(threads)

    def round_() -> None:
        assert all(torch.equal(run(*c), a) for c, a in zip(calls, alone, strict=True))

    lent_a_helper(round_)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_int8_gives_fake_quants_codes(dtype, static):
    """q * scale, rounded to x's dtype, is fake_quant bit for bit (zero rows, clamped outliers)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 96, generator=g) * torch.rand(2, 5, 1, generator=g) * 4).to(dtype)
    x[0, 1], x[1, 2, 3] = 0.0, 60.0
    static_scale = torch.tensor([0.02]) if static else None
    strategy = "tensor" if static else "token"
    q, scale = quantize_int8(x, strategy, static_scale)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == ((1,) if static else (10,))
    dequant = q.to(dtype) * scale.to(dtype).view(-1, 1).view(*([1] if static else [2, 5]), 1)
    assert torch.equal(dequant, fake_quant(x, "int8", strategy, static_scale=static_scale))
    assert q.min() == -128 or static  # NOTE: -amax / 127.5 rounds to -128 where the min is amax
    with pytest.raises(ValueError, match="per token or tensor"):
        quantize_int8(x, "group")


def _layer(n, k, static, seed=0):
    """A quantized linear's leaves, and its codes and scales (n, k) and (n, 1)."""
    _, _, codes, packed, scales, flat = _operands(1, n, k, seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    layer = SimpleNamespace(
        weight=packed,
        weight_scale=scales,
        weight_zero=None,
        weight_perm=None,
        bias=bias,
        out_features=n,
        in_features=k,
        input_scale=torch.tensor([0.03]) if static else None,
    )
    return layer, codes, flat


def _scheme(act: ActQuant, group_size=None) -> QuantScheme:
    return QuantScheme("compressed-tensors", "ct-int", 8, group_size, True, act=act)


@pytest.mark.parametrize("static", [False, True])
def test_the_layer_runs_w8a8_in_integers(static):
    """QuantMethod.apply takes the integer op for int8 inputs against per-channel weights, and
    it agrees with the float path (fake-quantized rows, dequantized weights) to fp32 rounding."""
    act = ActQuant("int8", "tensor" if static else "token", static=static)
    method, (layer, codes, s) = QuantMethod(_scheme(act)), _layer(70, 130, static)
    x = torch.randn(2, 9, 130, generator=torch.Generator().manual_seed(2))
    assert method.int8_gemm and quant.runs_native_i8(x)
    xq, xs = quantize_int8(x, act.strategy, layer.input_scale)
    want = OPS.quant_linear_i8(xq, xs, layer.weight, layer.weight_scale, layer.bias, 70, x.dtype)
    assert torch.equal(method.apply(layer, x), want)
    rows = method.quantize_input(x, layer.input_scale)
    floats = OPS.quant_linear(rows, layer.weight, layer.weight_scale, None, layer.bias, 70, 8, 130)
    # NOTE: the float path's fp32 sums of x * u less (128 * s) * sum(x): its terms' magnitude
    magnitude = rows.abs() @ (s * (codes.float() + 128)).T
    assert ((floats - want).abs() <= 2.0**-24 * (130 + 8) * magnitude + 1e-30).all()
    assert not torch.equal(floats, want)  # NOTE: not the float path itself


def test_other_schemes_keep_the_float_path():
    token = ActQuant("int8", "token")
    assert not QuantMethod(_scheme(token, group_size=32)).int8_gemm
    assert not QuantMethod(_scheme(None)).int8_gemm
    fp8 = QuantScheme("compressed-tensors", "ct-float", 8, None, True, number="fp8", act=token)
    assert not QuantMethod(fp8).int8_gemm
    asym = QuantScheme("compressed-tensors", "ct-int", 8, None, False, act=token)
    assert not QuantMethod(asym).int8_gemm
    assert not quant.runs_native_i8(torch.randn(2, 8).half())


def test_bad_input_is_refused():
    xq, xs, codes, packed, scales, _ = _operands(2, 40, 64, seed=0)

    def call(xq=xq, xs=xs, packed=packed, scales=scales, bias=None, n=40, dt=torch.float32):
        return OPS.quant_linear_i8(xq, xs, packed, scales, bias, n, dt)

    grouped = torch.cat([scales, scales], dim=1)
    refusals = [
        (lambda: call(xq=xq.float()), "int8 rows"),
        (lambda: call(xq=xq[:, :32]), "features"),
        (lambda: call(scales=grouped), "one per output channel"),
        (lambda: call(packed=OPS.quant_pack(codes & 15, 4)), "features"),
        (lambda: call(xs=xs.double()), "x_scale"),
        (lambda: call(xs=torch.ones(3)), "x_scale"),
        (lambda: call(n=80), "out_features"),
        (lambda: call(dt=torch.float16), "dtype"),
        (lambda: call(bias=torch.ones(39)), "bias"),
        (
            lambda: call(
                xq=torch.zeros(1, 65537, dtype=torch.int8),
                packed=torch.zeros(2, 65537, 32, dtype=torch.uint8),
                xs=xs[:1],
            ),
            "65536",
        ),
    ]
    for f, message in refusals:
        with pytest.raises(RuntimeError, match=message):
            f()
