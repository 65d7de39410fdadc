"""The native weight-only quantized GEMM (``kernels/native/csrc/quant_gemm.cpp``): 4- and
8-bit codes and FP8 e4m3 codes (``bits = -8``) in "panel32" panels against a float64 dequantized
reference, in every instruction set this CPU can run (FP8 by each route it can: fp16, subnormal,
table); the packed layout against a direct construction; bad input refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import lent_a_helper, runnable_isas
from warmboot.kernels import native

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

OPS = torch.ops.warmboot_cpu


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


FP8_ROUTES = {"fp16": 0, "subnormal": 1, "table": 2}  # csrc's Fp8Routes bits


def _fp8_routes(routes: int) -> int:
    """Turn FP8's routes to ``routes``, the previous ones back; skip where the CPU cannot."""
    try:
        return OPS.quant_fp8_routes(routes)
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(params=list(FP8_ROUTES))
def route(request):
    """One FP8 route alone (by default the kernels take the table one for bf16 x where the CPU
    has AVX-512 VBMI, the subnormal one for fp32 FMAs on AMD, fp16 elsewhere)."""
    before = _fp8_routes(FP8_ROUTES[request.param])
    yield request.param
    OPS.quant_fp8_routes(before)


def _fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 e4m3 values by torch's own conversion; the NaN codes 0x7F / 0xFF as the kernels
    read them, +-480 (checkpoints hold no NaN weights)."""
    v = codes.view(torch.float8_e4m3fn).double()
    return torch.where(codes == 0x7F, 480.0, torch.where(codes == 0xFF, -480.0, v))


def _fp8_codes(n, k, seed) -> torch.Tensor:
    """e4m3 codes of normal values times 10^[-3, 2] per column: subnormals to 448, no NaN."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 10 ** (torch.rand(k, generator=g) * 5 - 3)
    return w.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _check_fp8(y, x, codes, scales, bias, gs) -> None:
    """_check's bound with |fp8(u)| for u + z + 32 (no zero points)."""
    n, k = codes.shape
    s = scales.double().transpose(1, 2).reshape(-1, k // gs)[:n].repeat_interleave(gs, 1)
    w = _fp8_values(codes) * s
    ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
    tol = (gs + k // gs + 4) * 2.0**-24 * (x.double().abs() @ w.abs().T) + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape
    assert (err <= tol).all(), f"worst error / bound {(err / tol).max().item():.3g}"


def _fp8(x, codes, scales, bias, gs):
    packed = OPS.quant_pack(codes, -8)
    return OPS.quant_linear(x, packed, scales, None, bias, codes.shape[0], -8, gs)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_fp8_every_code_exactly(isa, route, m):
    """All 256 codes (rows of 256 outputs, each input a shift of the codes) against torch's
    float8_e4m3fn -> float32, x one-hot rows (fp32 and bf16: the values are exact in bf16),
    scales 2^-3: every output one exact product."""
    n = k = 256
    codes = ((torch.arange(n)[:, None] + torch.arange(k) * 37) % 256).to(torch.uint8)
    scales = torch.full((n // 32, 1, 32), 0.125)
    want = (_fp8_values(codes) * 0.125).float()
    for start in (0, 91, 248):
        x = torch.eye(k)[start : start + m]
        for xdt in (torch.float32, torch.bfloat16):
            y = _fp8(x.to(xdt), codes, scales, None, k)
            assert torch.equal(y.float(), want[:, start : start + m].T), (start, xdt)


# (rows, out_features, in_features, group_size): per channel and groups of 128 (block-like)
FP8_SHAPES = [
    (1, 33, 256, 128),
    (3, 100, 384, 384),
    (8, 64, 256, 128),
    (17, 70, 128, 128),
    (64, 33, 256, 256),
]


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_fp8_matches_float64(isa, route, xdt):
    """Every FP8 shape with fp16/bf16/fp32 scales, bias or none."""
    sdts = [torch.float16, torch.bfloat16, torch.float32]
    for i, ((m, n, k, gs), sdt) in enumerate(itertools.product(FP8_SHAPES, sdts)):
        codes, scales, _ = _quantized(n, k, 8, gs, sdt, zeros=False, seed=i)
        codes = _fp8_codes(n, k, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)).to(xdt)
        bias = torch.randn(n).to(xdt if i % 3 else torch.float32) if i % 2 else None
        y = _fp8(x, codes, scales, bias, gs)
        assert y.dtype == xdt
        _check_fp8(y, x, codes, scales, bias, gs)


def test_fp8_odd_groups_large_x_and_quant_dequantize(isa, route):
    """Odd group sizes (a k of their own last) in fp32 and bf16, x over 10^[-3, 6], and the
    result against quant.dequantize's dense weight (the Python fallback's)."""
    from warmboot.kernels import quant

    codes = _fp8_codes(37, 45, seed=3)
    x = torch.randn(5, 45) * torch.logspace(-3, 6, 45)
    for gs in (1, 15, 45):
        scales = _quantized(37, 45, 8, gs, torch.float32, zeros=False)[1]
        xb = x.bfloat16()
        _check_fp8(_fp8(xb, codes, scales, None, gs), xb, codes, scales, None, gs)
        y = _fp8(x, codes, scales, None, gs)
        _check_fp8(y, x, codes, scales, None, gs)
        w = quant.dequantize(OPS.quant_pack(codes, -8), scales, None, -8, gs, 37).double()
        bound = (gs + 45 // gs + 5) * 2.0**-24 * (x.double().abs() @ w.abs().T)
        assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("isa_name", ["avx2", "avx512", "avx512_bf16"])
@pytest.mark.parametrize("other", ["subnormal", "table"])
def test_fp8_routes_agree_bit_for_bit_even_with_daz(isa_name, other):
    """The routes differ by powers of 2 only: the fp16 route's bits, also where this thread
    zeroes subnormal inputs (MXCSR.DAZ: the subnormal route lifts it for the call, vcvtph2ps
    ignores it). The table route against fp16's dot products: bf16 x, 3 rows."""
    if isa_name not in runnable_isas() or (other == "table" and isa_name != "avx512_bf16"):
        pytest.skip(f"{other} does not run on {isa_name} here")
    best, before = native.isa(), _fp8_routes(0)
    codes, threads = _fp8_codes(70, 256, seed=5), torch.get_num_threads()
    scales = _quantized(70, 256, 8, 128, torch.bfloat16, zeros=False)[1]
    x = torch.randn(3, 256).to(torch.bfloat16 if other == "table" else torch.float32)
    OPS.use_isa(isa_name)
    torch.set_num_threads(1)
    try:
        fp16 = _fp8(x, codes, scales, None, 128)
        for daz, routes in itertools.product([False, True], [0, FP8_ROUTES[other]]):
            assert torch.set_flush_denormal(daz) or not daz
            _fp8_routes(routes)
            assert torch.equal(_fp8(x, codes, scales, None, 128), fp16), (daz, routes)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
        OPS.quant_fp8_routes(before)
        OPS.use_isa(best)


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


@pytest.mark.parametrize("bits", [4, -8])
def test_threads_and_a_helper_change_no_bit(bits):
    """Panels split between threads or lent to a helper thread give the caller's bits."""
    codes, scales, zeros = _quantized(3000, 576, abs(bits), 32, zeros=bits > 0)
    if bits < 0:
        codes = _fp8_codes(3000, 576, seed=1)
    packed = OPS.quant_pack(codes, bits)
    calls = [
        (torch.randn(m, 576).to(dt), dt) for m, dt in [(1, torch.bfloat16), (5, torch.float32)]
    ]

    def run(x):
        return OPS.quant_linear(x, packed, scales, zeros, None, 3000, bits, 32)

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
    packed8 = OPS.quant_pack(codes, -8)

    def call(x=x, packed=packed, scales=scales, zeros=zeros, bias=None, n=40, bits=4, gs=32):
        return OPS.quant_linear(x, packed, scales, zeros, bias, n, bits, gs)

    refusals = [
        (lambda: OPS.quant_pack(codes, 3), "bits must be 4, 8 or -8"),
        (lambda: OPS.quant_pack(codes.int(), 4), "uint8 codes"),
        (lambda: OPS.quant_pack(codes[0], 8), "2-D uint8"),
        (lambda: OPS.quant_pack(codes[:, :63], 4), "even in_features"),
        (lambda: OPS.quant_pack(codes | 16, 4), "below 16"),
        (lambda: call(bits=3), "bits must be 4, 8 or -8"),
        (lambda: call(bits=-8, packed=packed8), r"FP8 codes \(bits -8\) take no zero points"),
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
