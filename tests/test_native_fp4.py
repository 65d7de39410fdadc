"""The native quantized GEMM on FP4 e2m1 codes (``bits = -4``, MXFP4: GPT-OSS's experts) in
"panel32" nibble panels, in every instruction set this CPU can run: every code exactly, then
against a float64 reference from an e2m1 decoding of our own (sign, 2 exponent bits, 1 mantissa
bit) over odd sizes, row counts, group sizes, power-of-two scales 2^-20 .. 2^10 and x dtypes;
the Python entry and its fallback; zero points and bad shapes refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import lent_a_helper
from warmboot.kernels import native, quant

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

OPS = torch.ops.warmboot_cpu
FP4 = -4


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of nibbles: bit 3 the sign, bits 1-2 the exponent (bias 1), bit 0 the
    mantissa; exponent 0 is subnormal (0 or 0.5)."""
    u = codes.long()
    e, m = (u >> 1) & 3, (u & 1).double()
    mag = torch.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e - 1).double())
    return torch.where(u & 8 != 0, -mag, mag)


def test_our_decoding_is_quant_spec():
    assert _e2m1(torch.arange(16)).tolist() == list(quant.FP4_VALUES)
    assert torch.equal(_e2m1(torch.arange(16)).signbit(), torch.arange(16) >= 8)


def _randn(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _codes(n, k, seed) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed)).byte()


def _scales(n, groups, dtype, seed, lo=-20, hi=10) -> torch.Tensor:
    """(P, G, 32) powers of two 2^[lo, hi] (MXFP4's e8m0 scales), rows past n zero."""
    g = torch.Generator().manual_seed(seed + 1)
    panels = -(-n // 32)
    s = 2.0 ** torch.randint(lo, hi + 1, (panels * 32, groups), generator=g).float()
    s[n:] = 0
    return quant.pack_groups(s).to(dtype)


def _weights(codes, scales, gs) -> torch.Tensor:
    n, k = codes.shape
    s = quant.unpack_groups(scales)[:n].double().repeat_interleave(gs, 1)
    return _e2m1(codes) * s


def _fp4(x, codes, scales, gs, bias=None, zeros=None):
    packed = OPS.quant_pack(codes, FP4)
    return OPS.quant_linear(x, packed, scales, zeros, bias, codes.shape[0], FP4, gs)


def _check(y, x, codes, scales, gs, bias=None) -> None:
    """|y - ref| within fp32 summation error: each product x * fp4(u) is exact (bf16 x, or
    fp32 x by fp32 FMAs), a chain of n roundings errs by at most n * 2^-24 of the sum of the
    terms' magnitudes (the bias one of them), and a chain is at most a group, the groups and 4
    more. bf16 output: one rounding on top (2^-8 relative allowed)."""
    n, k = codes.shape
    w = _weights(codes, scales, gs)
    b = bias.double() if bias is not None else torch.zeros(n, dtype=torch.float64)
    ref = x.double() @ w.T + b
    tol = (gs + k // gs + 4) * 2.0**-24 * (x.double().abs() @ w.abs().T + b.abs()) + 1e-300
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert (err <= tol).all(), f"worst error / bound {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 4, 8, 9])
def test_every_code_exactly(isa, m):
    """All 16 codes (negative zero among them) in every output row and input, x one-hot rows,
    scales powers of two: every output is one exact product fp4(u) * s (exact in fp32 and
    bf16), a -0 weight reads as 0."""
    n, k = 80, 96
    codes = ((torch.arange(n)[:, None] + torch.arange(k) * 7) % 16).byte()
    for sdt, start in itertools.product([torch.float32, torch.bfloat16], (0, 37, 87)):
        scales = _scales(n, k // 32, sdt, seed=start)
        want = _weights(codes, scales, 32)[:, start : start + m].T
        for xdt in (torch.float32, torch.bfloat16):
            x = torch.eye(k)[start : start + m].to(xdt)
            y = _fp4(x, codes, scales, 32)
            assert torch.equal(y.double(), want), (sdt, start, xdt)


# (rows, out_features, in_features, group_size): K not a multiple of 64, N not of 32, group
# sizes 32 (MXFP4), 2, 6 and per channel
SHAPES = [
    (1, 33, 96, 32),
    (2, 100, 160, 32),
    (3, 70, 224, 32),
    (4, 31, 64, 2),
    (5, 64, 96, 6),
    (8, 97, 288, 32),
    (9, 40, 96, 96),
    (16, 65, 160, 32),
    (17, 70, 32, 32),
    (33, 5, 96, 32),
    (70, 130, 96, 48),
]


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_matches_float64(isa, xdt):
    """Every shape with bf16/fp32/fp16 scales (2^-20 .. 2^10; fp16: 2^-14 .. 2^10, normals),
    bias or none, x spanning 10^[-3, 3]."""
    sdts = [torch.bfloat16, torch.float32, torch.float16]
    for i, ((m, n, k, gs), sdt) in enumerate(itertools.product(SHAPES, sdts)):
        codes = _codes(n, k, seed=i)
        assert codes.unique().numel() == 16
        scales = _scales(n, k // gs, sdt, seed=i, lo=-14 if sdt == torch.float16 else -20)
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(m, k, generator=g) * 10 ** (torch.rand(k, generator=g) * 6 - 3)).to(xdt)
        bias = _randn(n, seed=i).to(xdt if i % 3 else torch.float32) if i % 2 else None
        _check(_fp4(x, codes, scales, gs, bias), x, codes, scales, gs, bias)


def test_table_route_and_shuffles_agree_bit_for_bit():
    """bf16 x on AVX-512 BF16: FP4's table route (VBMI, 1 row) and the shuffles (without
    it, and from 2 rows) place the same exact values in the same dot products."""
    if native.isa() != "avx512_bf16":
        pytest.skip("no AVX-512 BF16 here")
    try:
        before = OPS.quant_fp8_routes(2)  # csrc's Fp8Routes: kTable, FP4's table route too
    except RuntimeError as e:
        pytest.skip(str(e))
    n, k, gs = 70, 320, 32
    codes, scales = _codes(n, k, seed=11), _scales(n, k // gs, torch.bfloat16, seed=11)
    xs = [_randn(m, k, seed=m).bfloat16() for m in (1, 2, 3, 4, 9, 11)]
    try:
        table = [_fp4(x, codes, scales, gs) for x in xs]
        OPS.quant_fp8_routes(0)
        shuffles = [_fp4(x, codes, scales, gs) for x in xs]
    finally:
        OPS.quant_fp8_routes(before)
    for x, a, b in zip(xs, table, shuffles, strict=True):
        _check(b, x, codes, scales, gs)
        assert torch.equal(a, b), x.shape[0]


def test_python_entry_and_fallback(isa):
    """quant.quant_linear (the native op) and quant.dequantize + torch's GEMM (its fallback)
    against the reference; the op's packing is quant.pack_codes'."""
    n, k, gs = 45, 192, 32
    codes, perm = (
        _codes(n, k, seed=7),
        torch.randperm(k, generator=torch.Generator().manual_seed(7)),
    )
    packed = quant.pack_codes(codes, FP4)
    assert torch.equal(OPS.quant_pack(codes, FP4), packed)
    scales = _scales(n, k // gs, torch.bfloat16, seed=7)
    for m, xdt in [(1, torch.bfloat16), (4, torch.float32), (16, torch.bfloat16)]:
        x = _randn(m, k, seed=m).to(xdt)
        y = quant.quant_linear(x, packed, scales, None, None, None, n, FP4, gs)
        _check(y, x, codes, scales, gs)
        yp = quant.quant_linear(x, packed, scales, None, perm, None, n, FP4, gs)
        _check(yp, x[:, perm], codes, scales, gs)
    w = quant.dequantize(packed, scales, None, FP4, gs, n, torch.float64)
    assert torch.equal(w, _weights(codes, scales, gs))


def test_threads_helper_and_daz_change_no_bit():
    """Panels split between threads, lent to a helper thread, or computed with MXCSR.DAZ set
    (no route reads subnormals) give the caller's bits."""
    n, k = 3000, 576
    codes, scales = _codes(n, k, seed=3), _scales(n, k // 32, torch.bfloat16, seed=3)
    packed = OPS.quant_pack(codes, FP4)
    xs = [_randn(m, k, seed=m).to(dt) for m, dt in [(1, torch.bfloat16), (5, torch.float32)]]

    def run(x):
        return OPS.quant_linear(x, packed, scales, None, None, n, FP4, 32)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    alone = [run(x) for x in xs]
    _check(alone[0], xs[0], codes, scales, 32)
    torch.set_num_threads(2)
    try:
        assert all(torch.equal(run(x), a) for x, a in zip(xs, alone, strict=True))
        if torch.set_flush_denormal(True):
            assert all(torch.equal(run(x), a) for x, a in zip(xs, alone, strict=True))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)

    def round_() -> None:
        assert all(torch.equal(run(x), a) for x, a in zip(xs, alone, strict=True))

    lent_a_helper(round_)


def test_zeros_and_bad_shapes_are_refused():
    codes = _codes(40, 64, seed=0)
    scales = _scales(40, 2, torch.float32, seed=0)
    zeros = torch.zeros_like(scales, dtype=torch.uint8)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"FP4 codes \(bits -4\) take no zero points"):
        _fp4(x, codes, scales, 32, zeros=zeros)
    with pytest.raises(RuntimeError, match="even group_size"):
        _fp4(torch.randn(1, 6), codes[:, :6], scales[:, :2], 3)
    with pytest.raises(RuntimeError, match="even in_features"):
        OPS.quant_pack(codes[:, :63], FP4)
    with pytest.raises(RuntimeError, match="below 16"):
        OPS.quant_pack(codes | 16, FP4)
    with pytest.raises(RuntimeError, match="features"):
        _fp4(torch.randn(2, 128), codes, scales, 32)
