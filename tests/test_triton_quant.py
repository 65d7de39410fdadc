"""``triton_quant_linear`` (Triton's interpreter) against ``quant.dequantize`` and a float64 GEMM.

The reference is the torch fallback's maths: the weight dequantized and rounded to x's dtype,
the bias rounded to x's dtype, then ``x @ W.T + bias`` in float64. Bound, elementwise:
``|y - ref| <= TOL * (|x| @ |W|.T + |bias|)``: float32 1e-5 (float32 accumulation over
K <= 128 inputs: about K * 2^-24), bfloat16 2^-8 and float16 2^-10 (twice the output's final
rounding). A wrong code, scale or zero in one group moves a result by about group/K of that
scale: far outside the bound.

Decoding is checked exactly: identity rows of x give ``y = W.T`` bit for bit; every FP8 byte
(subnormals, both zeros, NaN 0x7F / 0xFF) and every FP4 nibble (low and high) appear; bf16
roundings tie to even. The default launch configs also compile for sm_90 (no GPU here).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run")

from warmboot.kernels import quant  # noqa: E402
from warmboot.kernels.quant import FP4, FP8  # noqa: E402
from warmboot.kernels.triton_quant import triton_quant_linear  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter
ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _codes(n: int, k: int, bits: int, g: torch.Generator) -> torch.Tensor:
    """Random codes (N, K); FP8 without its NaN bytes (random x would spread them)."""
    codes = torch.randint(0, 1 << abs(bits), (n, k), generator=g).to(torch.uint8)
    if bits == FP8:
        codes[(codes & 0x7F) == 0x7F] ^= 1
    return codes


def _pack(codes, bits, gs, g, scale_dtype=torch.float32, asym=False):
    """(packed, scales, zeros) of codes (N, K): scales about 1 / 2^bits, random zero codes."""
    n, k = codes.shape
    width = abs(bits)
    scales = ((torch.rand(n, k // gs, generator=g) + 0.5) / (1 << width)).to(scale_dtype)
    zeros = None
    if asym:
        zeros = quant.pack_groups(torch.randint(0, 1 << width, (n, k // gs), generator=g).byte())
    return quant.pack_codes(codes, bits), quant.pack_groups(scales), zeros


def _run_and_check(x, packed, scales, zeros, bias, n, bits, gs, **blocks) -> torch.Tensor:
    y = triton_quant_linear(x, packed, scales, zeros, bias, n, bits, gs, **blocks)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], n)
    w = quant.dequantize(packed, scales, zeros, bits, gs, n, x.dtype).double()
    xd = x.double()
    ref, bound = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        b = bias.to(x.dtype).double()
        ref, bound = ref + b, bound + b.abs()
    err = (y.double() - ref).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= TOL[x.dtype] * bound).all(), f"error {worst:.3g} of the bound's scale"
    return y


def _identity_check(codes, bits, gs, dtype, scale_dtype, g):
    """x = I (K rows): y[k, n] must be the rounded weight W[n, k] exactly (NaN where W is)."""
    n, k = codes.shape
    packed, scales, _ = _pack(codes, bits, gs, g, scale_dtype)
    x = torch.eye(k, dtype=dtype)
    y = triton_quant_linear(x, packed, scales, None, None, n, bits, gs)
    w = quant.dequantize(packed, scales, None, bits, gs, n, dtype)
    return y, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gs", [32, 64, 128])  # 128 = K: per channel
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_integer(bits, asym, gs, dtype):
    """int8/int4, symmetric and with zero points (and a bias), N = 40 (a padded panel)."""
    g = _gen(bits, asym, gs, dtype)
    n, k = 40, 128
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    packed, scales, zeros = _pack(_codes(n, k, bits, g), bits, gs, g, scale_dtype, asym)
    x = torch.randn(3, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if asym else None
    _run_and_check(x, packed, scales, zeros, bias, n, bits, gs)


@pytest.mark.parametrize(
    "bits,k,gs",
    [(8, 48, 48), (8, 40, 40), (8, 64, 8), (8, 24, 3), (4, 48, 48), (4, 64, 16), (4, 24, 3)],
)
def test_group_shapes(bits, k, gs):
    """Group sizes whose power-of-two factor is under a step (a scale and zero per code, K
    masked) and a 16-input step (int8, 48): K not a multiple of 32, 4-bit pairs split
    across groups (3)."""
    g = _gen(bits, k, gs)
    n = 33
    packed, scales, zeros = _pack(_codes(n, k, bits, g), bits, gs, g, asym=True)
    x = torch.randn(5, k, generator=g)
    _run_and_check(x, packed, scales, zeros, torch.randn(n, generator=g), n, bits, gs)


@pytest.mark.parametrize(
    "lead,n,dtype,blocks",
    [
        ((1,), 32, torch.float32, {}),
        ((17,), 70, torch.bfloat16, {}),  # two row tiles
        ((2, 3), 1, torch.float16, {}),  # one output column
        ((33,), 70, torch.float32, {}),  # 64-row tiles, 64-column tiles
        ((5,), 70, torch.float16, dict(block_m=16, block_n=64, block_k=32)),  # a missing panel
        ((3,), 96, torch.bfloat16, dict(block_n=128)),  # a tile wider than N's panels
    ],
)
def test_rows_and_tiles(lead, n, dtype, blocks):
    """Leading dims, odd row counts, N not a multiple of 32, tile overrides; strided x."""
    g = _gen(lead, n, dtype, blocks)
    bits, k, gs = 4, 64, 32
    packed, scales, zeros = _pack(_codes(n, k, bits, g), bits, gs, g, asym=True)
    x = torch.randn(*lead, 2 * k, generator=g).to(dtype)[..., ::2]  # not contiguous
    _run_and_check(x, packed, scales, zeros, None, n, bits, gs, **blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [FP8, FP4])
def test_float_codes(bits, dtype):
    """FP8 / FP4 codes with random x, a bias, bf16 scales."""
    g = _gen(bits, dtype)
    n, k, gs = 40, 64, 32
    packed, scales, _ = _pack(_codes(n, k, bits, g), bits, gs, g, torch.bfloat16)
    x = torch.randn(4, k, generator=g).to(dtype)
    _run_and_check(x, packed, scales, None, torch.randn(n, generator=g), n, bits, gs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_every_byte(dtype):
    """All 256 bytes; NaN bytes only in rows 3 and 7 (0 * NaN = NaN poisons their columns)."""
    g = _gen("fp8", dtype)
    n, k, gs = 40, 64, 32
    values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = values[torch.randint(0, len(values), (n, k), generator=g)]
    codes[10:14].view(-1)[: len(values)] = values[torch.randperm(len(values), generator=g)]
    codes[3, 5], codes[7, 60] = 0x7F, 0xFF
    assert len(codes.unique()) == 256  # subnormals 0x01-0x07 and 0x81-0x87 included
    y, w = _identity_check(codes, FP8, gs, dtype, torch.float32, g)
    nan_cols = [3, 7]
    assert y[:, nan_cols].isnan().all()
    keep = [c for c in range(n) if c not in nan_cols]
    assert len(codes[keep].unique()) == 254 and not w[keep].isnan().any()
    assert torch.equal(y[:, keep], w[keep].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_every_nibble(dtype):
    """All 16 nibbles at even (low) and odd (high) inputs, each exactly."""
    g = _gen("fp4", dtype)
    n, k, gs = 33, 64, 32
    codes = _codes(n, k, FP4, g)
    codes[0, 0:32:2] = torch.arange(16, dtype=torch.uint8)
    codes[1, 1:32:2] = torch.arange(16, dtype=torch.uint8)
    y, w = _identity_check(codes, FP4, gs, dtype, torch.float32, g)
    assert torch.equal(y, w.T)


def test_bf16_ties():
    """Weights halfway between two bf16 values round to the even one, as torch's cast does:
    scales 1 + 2^-8 (ties down) and 1 + 3 * 2^-8 (ties up) times codes +-2^i; then a bias."""
    g = _gen("ties")
    n, k, gs = 40, 64, 32
    codes = _codes(n, k, 8, g)
    scales = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8])[torch.randint(0, 2, (n, 2), generator=g)]
    packed, scales = quant.pack_codes(codes, 8), quant.pack_groups(scales)
    y = triton_quant_linear(
        torch.eye(k, dtype=torch.bfloat16), packed, scales, None, None, n, 8, gs
    )
    w = quant.dequantize(packed, scales, None, 8, gs, n, torch.bfloat16)
    bits = quant.dequantize(packed, scales, None, 8, gs, n).view(torch.int32)
    ties = (bits & 0xFFFF) == 0x8000
    assert (ties & (bits & 0x10000 == 0)).sum() > 10 and (ties & (bits & 0x10000 != 0)).sum() > 10
    assert torch.equal(y, w.T)
    bias = torch.randn(n, generator=g)  # rounded to bf16, then added: one rounding of the sum
    y = triton_quant_linear(
        torch.eye(k, dtype=torch.bfloat16), packed, scales, None, bias, n, 8, gs
    )
    assert torch.equal(y, (w.T.double() + bias.bfloat16().double()).bfloat16())


def test_refusals():
    g = _gen("refuse")
    n, k, gs = 32, 64, 32
    x = torch.randn(2, k, generator=g)
    for bits in (FP8, FP4):
        packed, scales, _ = _pack(_codes(n, k, bits, g), bits, gs, g)
        zeros = torch.zeros_like(scales, dtype=torch.uint8)
        with pytest.raises(ValueError, match="take no zeros"):
            triton_quant_linear(x, packed, scales, zeros, None, n, bits, gs)
    packed, scales, _ = _pack(_codes(n, k, 8, g), 8, gs, g)
    with pytest.raises(ValueError, match="bits must be"):
        triton_quant_linear(x, packed, scales, None, None, n, 3, gs)
    with pytest.raises(ValueError, match="packed must be"):
        triton_quant_linear(x, packed, scales, None, None, n, 4, gs)
    with pytest.raises(ValueError, match="group size"):
        triton_quant_linear(x, packed, scales, None, None, n, 8, 48)
    with pytest.raises(ValueError, match="x must be"):
        triton_quant_linear(x.double(), packed, scales, None, None, n, 8, gs)


AOT_CASES = [  # (x dtype, rows, K, bits, group size, zeros): defaults of decode and prefill
    ("bfloat16", 1, 4096, 4, 128, True),
    ("bfloat16", 1, 4096, 8, 4096, False),
    ("bfloat16", 1, 4096, FP8, 128, False),
    ("bfloat16", 1, 2880, FP4, 32, False),
    ("float16", 128, 4096, 4, 16, True),
    ("bfloat16", 128, 4096, FP8, 128, False),
    ("float32", 1, 4096, 4, 128, False),
    ("float32", 128, 4096, 8, 128, True),
]
AOT_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/bench")
import torch
from sass_check import compile_kernel, sass_opcodes, tools_available
from warmboot.kernels import triton_quant as tq
out = {}
for dtype, m, k, bits, gs, zeros in json.loads(sys.argv[2]):
    cfg = tq.launch_config(getattr(torch, dtype), m, k, bits, gs, zeros, True)
    t = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}[dtype]
    ptrs = dict(X=t, Codes="*u8", Scales="*bf16", Zeros="*u8", Bias="*bf16", Y=t)
    ops = sass_opcodes(compile_kernel(tq._quant_linear_kernel, cfg, ptrs, set(), 90).asm["cubin"])
    out[repr((dtype, m, k, bits, gs, zeros))] = dict(
        mma=sum(n for op, n in ops.items() if "MMA." in op and "FMA" not in op),
        local=ops.get("LDL", 0) + ops.get("STL", 0), emu=cfg["EMU_BF16"])
print(json.dumps(out))
"""


def _aot_tools() -> bool:
    """ptxas / cuobjdump in Triton's wheel (as ``tests.test_triton_aot``)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return all((bin_dir / t).is_file() for t in ("ptxas", "cuobjdump"))


@pytest.mark.skipif(not _aot_tools(), reason="ptxas/cuobjdump not shipped with this Triton wheel")
def test_sm90_compile(tmp_path):
    """The default launch configs compile ahead of time for sm_90 (no GPU: a subprocess
    without the interpreter): bf16/fp16 x on tensor cores, no local memory (spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    args = [sys.executable, "-c", AOT_SCRIPT, str(ROOT), json.dumps(AOT_CASES)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.splitlines()[-1])
    assert len(kernels) == len(AOT_CASES)
    for case, got in kernels.items():
        assert not got["emu"] and got["local"] == 0, (case, got)
        assert got["mma"] > 0 or "float32" in case, (case, got)
