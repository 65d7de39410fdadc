"""The quantized linear in Triton: ``y = x @ dequant(W).T + bias`` with W in ``kernels.quant``'s
"panel32" layout, dequantized tile by tile in registers (never materialised in memory).

Same semantics as ``quant_linear``'s torch fallback (``dequantize`` to x's dtype, then
``F.linear``): a weight is computed in float32 (``(u - z) * s``, ``fp8(u) * s`` or
``fp4(u) * s``), rounded once to x's dtype and multiplied with x on the tensor cores with float32
accumulation (float32 x: ``input_precision="ieee"``, no TF32, as torch's default); the bias is
rounded to x's dtype and added to the float32 sum, which is rounded once to the output.

Grid ``(row tiles of x, column tiles)``: a program owns ``BLOCK_M`` rows of x and ``BLOCK_N``
output columns (``BLOCK_N / 32`` whole panels) and walks K in ``BLOCK_K`` steps. When
``BLOCK_K`` divides the group size, a step reads one scale (and zero) per column; otherwise
(group sizes with a power-of-two factor under 16, or 32 for 4 bits) one per code. 4-bit codes:
a step loads ``BLOCK_K / 2`` bytes per column and makes two dots, the low nibbles with x's even
inputs, the high nibbles with the odd ones (no interleave in registers).

Decoding, all integer/bit arithmetic (exact in the interpreter and on any GPU, no fp8 dtype):

- integer: ``(u - z) * s``, ``z`` the zero code or ``2^(bits-1)``;
- FP8 e4m3fn: exponent ``e`` and mantissa ``m`` give the float32 bits
  ``(e + 120) << 23 | m << 20`` (``e > 0``) or ``m * 2^-9`` (subnormal), the sign applied after;
  0x7F / 0xFF decode to NaN (e4m3fn has no infinities);
- FP4 e2m1: ``m / 2`` (``e == 0``) or ``(2 + m) << e >> 1`` halves, bit 3 the sign.

No split-K (decode rows: ``BLOCK_M = 16``, ``BLOCK_N = 32``, as many programs as panels). K
and the group size are constexprs (Triton 3.6's interpreter cannot loop to an int argument):
one compile per layer shape, N and M free. No host synchronisation, launches depend only on
shapes (CUDA-graph capturable). On the CPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``): slow, for tests only; there bf16 is emulated (``EMU_BF16``: the
interpreter's casts to bf16 truncate and its dots multiply bf16 bit patterns).

GPU unverified: tested in the interpreter only, and compiled ahead of time for sm_90 (tensor-core
MMAs, no spills; ``tests/test_triton_quant.py``), never run on a GPU; tile sizes and
``num_warps`` are untuned guesses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmboot.kernels import tuning
from warmboot.kernels.quant_layout import COLS, FP4, FP8, packed_shapes

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KINDS = {8: 0, 4: 0, FP8: 1, FP4: 2}  # 0 integer, 1 FP8 e4m3, 2 FP4 e2m1
MAX_BLOCK_K = 128
PANEL = tl.constexpr(COLS)


@triton.jit
def _fp8_e4m3(u):
    """Codes (int32 in [0, 256)) -> float32 e4m3fn values."""
    e = (u >> 3) & 15
    m = u & 7
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    v = tl.where((u & 0x80) != 0, -mag, mag)
    return tl.where((u & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _fp4_e2m1(u):
    """Codes (int32 in [0, 16)) -> float32 e2m1 values."""
    e = (u >> 1) & 3
    m = u & 1
    halves = tl.where(e == 0, m, ((2 + m) << e) >> 1)
    mag = halves.to(tl.float32) * 0.5
    return tl.where((u & 8) != 0, -mag, mag)


@triton.jit
def _weights(u, kk, k_ok, n_ok, k0, S, Z, KIND, ZERO, GROUP, ONE_GROUP):
    """float32 weights (BLOCK, BLOCK_N) of codes ``u`` (int32) at inputs ``kk``; S / Z: the
    columns' scales / zeros at group 0; ZERO: the symmetric zero code, -1: Z's."""
    if ONE_GROUP:
        off = (k0 // GROUP) * PANEL
        mask = n_ok[None, :]
    else:
        off = (kk // GROUP)[:, None] * PANEL
        mask = k_ok[:, None] & n_ok[None, :]
    s = tl.load(S[None, :] + off, mask=mask, other=0.0).to(tl.float32)
    if KIND == 1:
        return _fp8_e4m3(u) * s
    if KIND == 2:
        return _fp4_e2m1(u) * s
    if ZERO < 0:
        z = tl.load(Z[None, :] + off, mask=mask, other=0).to(tl.int32)
    else:
        z = ZERO
    return (u - z).to(tl.float32) * s


@triton.jit
def _round_bf16(v):
    """float32 -> float32 rounded to bfloat16 (to nearest, ties to even) by its bits."""
    b = v.to(tl.uint32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _mma(x_rows, m_ok, kk, k_ok, stride_xk, w, acc, EMU_BF16: tl.constexpr):
    """acc + x[rows, kk] @ w, w rounded to x's dtype; float32 x without TF32."""
    x = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if EMU_BF16:  # the bf16 product in float32: exact
        return tl.dot(x.to(tl.float32), _round_bf16(w), acc, input_precision="ieee")
    if x.dtype == tl.float32:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _quant_linear_kernel(
    X,
    Codes,
    Scales,
    Zeros,
    Bias,
    Y,
    M,
    N,
    stride_xm,
    stride_xk,
    stride_ym,
    K: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMU_BF16: tl.constexpr,
):
    """Y[rows, cols] of one (BLOCK_M, BLOCK_N) tile; BITS is the code width (8 or 4).
    EMU_BF16: bf16 in Triton 3.6's interpreter, whose casts to bf16 truncate and whose dots
    multiply bf16 bit patterns: roundings by ``_round_bf16``, products in float32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    panel = (offs_n // PANEL).to(tl.int64)
    col = offs_n % PANEL
    code_cols = panel * (K * BITS // 8 * PANEL) + col  # each panel: K * BITS / 8 rows of 32
    group_cols = panel * (K // GROUP * PANEL) + col
    S = Scales + group_cols
    Z = Zeros + group_cols
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 8:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            mask = k_ok[:, None] & n_ok[None, :]
            u = tl.load(Codes + kk[:, None] * PANEL + code_cols[None, :], mask=mask, other=0)
            u = u.to(tl.int32)
            w = _weights(u, kk, k_ok, n_ok, k0, S, Z, KIND, ZERO, GROUP, ONE_GROUP)
            acc = _mma(x_rows, m_ok, kk, k_ok, stride_xk, w, acc, EMU_BF16)
        else:
            kj = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte rows: inputs 2j (low), 2j + 1
            even = 2 * kj
            k_ok = even < K
            mask = k_ok[:, None] & n_ok[None, :]
            b = tl.load(Codes + kj[:, None] * PANEL + code_cols[None, :], mask=mask, other=0)
            b = b.to(tl.int32)
            w = _weights(b & 15, even, k_ok, n_ok, k0, S, Z, KIND, ZERO, GROUP, ONE_GROUP)
            acc = _mma(x_rows, m_ok, even, k_ok, stride_xk, w, acc, EMU_BF16)
            w = _weights(b >> 4, even + 1, k_ok, n_ok, k0, S, Z, KIND, ZERO, GROUP, ONE_GROUP)
            acc = _mma(x_rows, m_ok, even + 1, k_ok, stride_xk, w, acc, EMU_BF16)
    out_ty = Y.dtype.element_ty
    if HAS_BIAS:
        bias = tl.load(Bias + offs_n, mask=n_ok, other=0.0)
        if EMU_BF16:
            acc += _round_bf16(bias.to(tl.float32))[None, :]
        else:
            acc += bias.to(out_ty).to(tl.float32)[None, :]
    if EMU_BF16:
        acc = _round_bf16(acc)  # the cast below then is exact
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(out_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def launch_config(
    dtype, m: int, k: int, bits: int, group_size: int, zeros: bool, bias: bool, blocks=None
) -> dict:
    """The kernel's constexprs for x of ``dtype`` and ``m`` rows. Tiles: decode rows (M <= 16)
    16 x 32 and up to 128-input steps, more rows 64 wide and up to 64 (float32 x: the
    shortest steps, its FMA dot spilled at 64 x 64 x 64 for sm_90). ``blocks``: overrides
    (``block_m``/``block_n``/``block_k``, powers of two; tests)."""
    blocks = blocks or {}
    min_k = 32 if abs(bits) == 4 else 16  # a dot takes >= 16 inputs; 4 bits: two half-steps
    bm = blocks.get("block_m") or (16 if m <= 16 else 32 if m <= 32 else 64)
    bn = blocks.get("block_n") or (COLS if m <= 16 else 2 * COLS)
    bk = blocks.get("block_k")
    if bk is None:
        pow2 = group_size & -group_size  # the largest power of two dividing the group size
        cap = MAX_BLOCK_K if bn == COLS else MAX_BLOCK_K // 2
        cap = min_k if dtype == torch.float32 and bn > COLS else cap
        bk = min(pow2, cap) if pow2 >= min_k else 32
    for name, v, lo in (("block_m", bm, 16), ("block_n", bn, COLS), ("block_k", bk, min_k)):
        _check(v >= lo and v & (v - 1) == 0, f"{name} {v} must be a power of two >= {lo}")
    return dict(
        K=k,
        KIND=_KINDS[bits],
        BITS=abs(bits),
        GROUP=group_size,
        ONE_GROUP=group_size % bk == 0,
        ZERO=-1 if zeros else 1 << (abs(bits) - 1),
        HAS_BIAS=bias,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EMU_BF16=tuning.interpreting() and dtype == torch.bfloat16,
    )


def _check_args(x, packed, scales, zeros, bias, n: int, bits: int, group_size: int) -> None:
    k = x.shape[-1] if x.dim() else 0
    _check(bits in _KINDS, f"bits must be 8, 4, FP8 ({FP8}) or FP4 ({FP4}): {bits}")
    _check(zeros is None or _KINDS[bits] == 0, f"FP8/FP4 codes (bits {bits}) take no zeros")
    _check(x.dtype in _X_DTYPES, f"x must be float32/bfloat16/float16: {x.dtype}")
    _check(n > 0 and k > 0, f"empty weight: {n} x {k}")
    _check(group_size > 0 and k % group_size == 0, f"group size {group_size} must divide {k}")
    _check(k * abs(bits) % 8 == 0, f"4-bit codes need an even number of inputs: {k}")
    codes_shape, group_shape = packed_shapes(n, k, bits, group_size)
    _check(
        packed.dtype == torch.uint8 and tuple(packed.shape) == codes_shape,
        f"packed must be uint8 {codes_shape}: {packed.dtype} {tuple(packed.shape)}",
    )
    _check(
        scales.dtype in _X_DTYPES and tuple(scales.shape) == group_shape,
        f"scales must be float {group_shape}: {scales.dtype} {tuple(scales.shape)}",
    )
    _check(
        zeros is None or (zeros.dtype == torch.uint8 and tuple(zeros.shape) == group_shape),
        f"zeros must be uint8 {group_shape}",
    )
    _check(bias is None or tuple(bias.shape) == (n,), f"bias must be ({n},)")
    for t in (packed, scales, zeros, bias):
        _check(t is None or t.device == x.device, "all tensors must be on x's device")


def triton_quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    bits: int,
    group_size: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``x (..., K) @ dequant(W).T + bias`` -> ``(..., out_features)`` in x's dtype.

    ``packed``/``scales``/``zeros``: the panel layout of ``kernels.quant`` (``bits`` 8, 4,
    ``FP8`` or ``FP4``; zeros only for integer codes, None: symmetric). x is already permuted
    (``perm`` applied by the caller); any strides. ``block_*``: tile overrides (tests)."""
    _check_args(x, packed, scales, zeros, bias, out_features, bits, group_size)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m:
        blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k)
        cfg = launch_config(
            x.dtype, m, k, bits, group_size, zeros is not None, bias is not None, blocks
        )
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(out_features, cfg["BLOCK_N"]))
        scales = scales.contiguous()
        _quant_linear_kernel[grid](
            x2,
            packed.contiguous(),
            scales,
            scales if zeros is None else zeros.contiguous(),
            scales if bias is None else bias.contiguous(),
            y,
            m,
            out_features,
            x2.stride(0),
            x2.stride(1),
            y.stride(0),
            num_warps=4,
            **cfg,
        )
    return y.view(*x.shape[:-1], out_features)
