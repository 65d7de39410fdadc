"""The native weight-only quantized GEMM (``kernels/native/csrc/quant_gemm.cpp``): 4- and
8-bit codes in "panel32" panels against a float64 dequantized reference, in every instruction
set this CPU can run; the packed layout against a direct construction; bad input refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import lent_a_helper
from warmboot.kernels import native

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

ISAS = ["portable", "avx2", "avx512", "avx512_bf16"]
OPS = torch.ops.warmboot_cpu


def _runnable() -> list[str]:
    best = native.isa()
    return ISAS[: ISAS.index(best) + 1] if best else []


@pytest.fixture(params=ISAS)
def isa(request):
    if request.param not in _runnable():
        pytest.skip(f"this CPU cannot run {request.param}")
    best = native.isa()
    OPS.use_isa(request.param)
    yield request.param
    OPS.use_isa(best)


def _quantized(n, k, bits, gs, sdt=torch.float16, zeros=True, seed=0):
    """codes (n, k), scales and zeros (panels, groups, 32) with the padded rows zero."""
    g = torch.Generator().manual_seed(seed)
    panels, groups = -(-n // 32), k // gs
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(panels * 32, groups, generator=g) * 0.02 + 1e-3
    scales[n:] = 0
    z = torch.randint(0, 2**bits, (panels * 32, groups), generator=g, dtype=torch.uint8)
    z[n:] = 0

    def panel(t):
        return t.view(panels, 32, groups).transpose(1, 2).contiguous()

    return codes, panel(scales).to(sdt), panel(z) if zeros else None


def _dequantized(codes, scales, zeros, bits, gs) -> torch.Tensor:
    """float64 (n, k) weights: (u - z) * s per group, straight from the codes."""
    n = codes.shape[0]
    s = scales.double().transpose(1, 2).reshape(-1, scales.shape[1])[:n]
    z = (
        zeros.transpose(1, 2).reshape(-1, zeros.shape[1])[:n].double()
        if zeros is not None
        else torch.full_like(s, 2.0 ** (bits - 1))
    )
    return (codes.double() - z.repeat_interleave(gs, 1)) * s.repeat_interleave(gs, 1)


def _check(y, x, codes, scales, zeros, bias, bits, gs) -> None:
    """|y - ref| within fp32 summation error. The kernels sum x * u and subtract (z * s) * xs
    per group (the BF16 dot products take x * (16 + u) and 16 + z for 4 bits), so the terms
    rounded are at most |x| * s * (u + z + 32); a chain of n fp32 roundings errs by at most
    n * 2^-24 of their sum, and a chain here is at most a group, the groups and 4 more. bf16
    output: one rounding (2^-9 relative) on top, 2^-8 allowed."""
    w = _dequantized(codes, scales, zeros, bits, gs)
    ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
    n, k = codes.shape
    z = zeros if zeros is not None else torch.full_like(scales, 2 ** (bits - 1), dtype=torch.uint8)
    s = scales.double().transpose(1, 2).reshape(-1, k // gs)[:n].repeat_interleave(gs, 1)
    zk = z.transpose(1, 2).reshape(-1, k // gs)[:n].double().repeat_interleave(gs, 1)
    magnitude = x.double().abs() @ (s * (codes.double() + zk + 32)).T
    tol = (gs + k // gs + 4) * 2.0**-24 * magnitude + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape
    assert (err <= tol).all(), f"worst error / bound {(err / tol).max().item():.3g}"


def _run(x, codes, scales, zeros, bias, bits, gs):
    packed = OPS.quant_pack(codes, bits)
    return OPS.quant_linear(x, packed, scales, zeros, bias, codes.shape[0], bits, gs)


# (rows, out_features, in_features, group_size): group sizes 32, 64, 128 and per channel
SHAPES = [
    (1, 33, 96, 32),
    (3, 100, 192, 64),
    (8, 64, 256, 128),
    (9, 40, 192, 192),
    (17, 70, 128, 32),
    (64, 33, 96, 96),
    (2, 5, 64, 64),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_matches_float64(isa, bits, xdt):
    """Every shape with every scales dtype, with zeros and without, bias or none."""
    sdts = [torch.float16, torch.bfloat16, torch.float32]
    for i, ((m, n, k, gs), sdt, zq) in enumerate(itertools.product(SHAPES, sdts, [False, True])):
        codes, scales, zeros = _quantized(n, k, bits, gs, sdt, zq, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)).to(xdt)
        bias = torch.randn(n).to(xdt if i % 3 else torch.float32) if i % 2 else None
        y = _run(x, codes, scales, zeros, bias, bits, gs)
        assert y.dtype == xdt
        _check(y, x, codes, scales, zeros, bias, bits, gs)


@pytest.mark.parametrize("gs", [1, 15, 45])
def test_odd_groups_of_8_bits(isa, gs):
    """8 bits take any group size: odd ones end on a k of their own."""
    codes, scales, zeros = _quantized(37, 45, 8, gs, torch.float32, zeros=gs != 15)
    for xdt in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 45).to(xdt)
        _check(_run(x, codes, scales, zeros, None, 8, gs), x, codes, scales, zeros, None, 8, gs)


def test_large_codes_and_values(isa):
    """Extreme codes and zero points (0 and 255) with large and small x."""
    codes, scales, zeros = _quantized(64, 128, 8, 32)
    codes[::2] = 255
    codes[1::4] = 0
    zeros[:, :, ::3] = 255
    x = torch.randn(4, 128) * torch.logspace(-3, 3, 128)
    _check(_run(x, codes, scales, zeros, None, 8, 32), x, codes, scales, zeros, None, 8, 32)


def test_leading_dims_zero_rows_and_non_contiguous_x():
    codes, scales, zeros = _quantized(50, 64, 4, 32)
    x = torch.randn(2, 3, 64)
    y = _run(x, codes, scales, zeros, None, 4, 32)
    assert y.shape == (2, 3, 50)
    _check(y.view(6, 50), x.view(6, 64), codes, scales, zeros, None, 4, 32)
    assert _run(torch.zeros(0, 64), codes, scales, zeros, None, 4, 32).shape == (0, 50)
    xt = torch.randn(64, 5).t()
    _check(_run(xt, codes, scales, zeros, None, 4, 32), xt, codes, scales, zeros, None, 4, 32)


@pytest.mark.parametrize("n, k", [(1, 2), (31, 130), (32, 128), (70, 1538), (97, 64)])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_packed_layout_exactly(n, k, bits):
    """(P, K, 32) codes or (P, K/2, 32) nibble pairs (even k low), rows past n zero."""
    codes = _quantized(n, k, bits, k)[0]
    panels = -(-n // 32)
    padded = torch.zeros(panels * 32, k, dtype=torch.uint8)
    padded[:n] = codes
    if bits == 4:
        padded = padded[:, 0::2] | padded[:, 1::2] << 4
    want = padded.view(panels, 32, -1).permute(0, 2, 1).contiguous()
    assert torch.equal(OPS.quant_pack(codes, bits), want)
    assert torch.equal(OPS.quant_pack(codes.t().contiguous().t(), bits), want)


def test_threads_and_a_helper_change_no_bit():
    """Panels split between threads or lent to a helper thread give the caller's bits."""
    codes, scales, zeros = _quantized(3000, 576, 4, 32)
    packed = OPS.quant_pack(codes, 4)
    calls = [
        (torch.randn(m, 576).to(dt), dt) for m, dt in [(1, torch.bfloat16), (5, torch.float32)]
    ]

    def run(x):
        return OPS.quant_linear(x, packed, scales, zeros, None, 3000, 4, 32)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    alone = [run(x) for x, _ in calls]
    torch.set_num_threads(2)
    try:
        assert all(torch.equal(run(x), a) for (x, _), a in zip(calls, alone, strict=True))
    finally:
        torch.set_num_threads(threads)

    def round_() -> None:
        assert all(torch.equal(run(x), a) for (x, _), a in zip(calls, alone, strict=True))

    lent_a_helper(round_)


def test_bad_input_is_refused():
    codes, scales, zeros = _quantized(40, 64, 4, 32)
    packed, x = OPS.quant_pack(codes, 4), torch.randn(2, 64)

    def call(x=x, packed=packed, scales=scales, zeros=zeros, bias=None, n=40, bits=4, gs=32):
        return OPS.quant_linear(x, packed, scales, zeros, bias, n, bits, gs)

    refusals = [
        (lambda: OPS.quant_pack(codes, 3), "bits must be 4 or 8"),
        (lambda: OPS.quant_pack(codes.int(), 4), "uint8 codes"),
        (lambda: OPS.quant_pack(codes[0], 8), "2-D uint8"),
        (lambda: OPS.quant_pack(codes[:, :63], 4), "even in_features"),
        (lambda: OPS.quant_pack(codes | 16, 4), "below 16"),
        (lambda: call(bits=3), "bits must be 4 or 8"),
        (lambda: call(packed=packed.float()), "quant_pack"),
        (lambda: call(x=x.double()), "float32 or bfloat16 rows"),
        (lambda: call(x=x[:, :32]), "features"),
        (lambda: call(n=80), "out_features"),
        (lambda: call(gs=24), "does not divide"),
        (lambda: call(gs=0), "does not divide"),
        (lambda: call(scales=scales.double()), "scales must be float16"),
        (lambda: call(scales=scales[:, :1]), r"scales must be \[2, 2, 32\]"),
        (lambda: call(zeros=zeros.float()), "zeros must be uint8"),
        (lambda: call(bias=torch.zeros(41)), "bias"),
        (lambda: call(x=x.bfloat16(), bias=torch.zeros(40, dtype=torch.float16)), "bias"),
    ]
    for fn, message in refusals:
        with pytest.raises(RuntimeError, match=message):
            fn()
    odd = _quantized(40, 6, 4, 6)[0]
    with pytest.raises(RuntimeError, match="even group_size"):
        OPS.quant_linear(
            torch.randn(1, 6), OPS.quant_pack(odd, 4), scales[:, :2], None, None, 40, 4, 3
        )
