"""Weight-only integer GEMMs: ``y = x @ dequant(W).T + b`` with W kept quantized in memory.

One layout for every format and device, the one stored in snapshots ("panel32"): the codes
(``u`` in ``[0, 2^bits)``) of 32 output rows side by side per input, so a decode GEMM streams
each panel once and unpacks it in registers (``csrc/quant_gemm.cpp``):

- 8 bits: uint8 ``(P, K, 32)``, ``[p, k, c]`` the code of row ``32p + c`` at input ``k``;
- 4 bits: uint8 ``(P, K/2, 32)``, inputs ``2j`` and ``2j + 1`` in the low and high nibble;
- FP8 (``FP8``) and FP4 (``FP4``, MXFP4's e2m1) codes: the 8- and 4-bit layouts, the bytes or
  nibbles float values, ``w = fp(u) * s``, no zero points;
- scales ``(P, G, 32)`` in the checkpoint's float dtype, one per row and group of
  ``group_size`` consecutive inputs; zero points likewise as uint8 codes, or none (symmetric:
  ``2^(bits-1)``). Rows past N are zero.

``w[n, k] = (u[n, k] - z[n, g]) * s[n, g]`` with ``g = k // group_size``. A checkpoint whose
groups are not consecutive inputs (GPTQ's ``desc_act``) carries ``perm``: the GEMM reads
``x[..., perm]``, the weights being stored in that order.

``warmboot::quant_linear`` is one op (opaque to a compiled step): the native kernel on the CPU
(at every row count: at 3072x576 it took 0.3 / 1.1 / 3.0 ms for 16 / 64 / 256 rows where
dequantizing the weight in torch for the call and torch's GEMM took 4-9 ms; FP8 codes too),
the Triton kernel on CUDA (``kernels.triton_quant``: interpreter-tested, GPU unverified), else
the weight dequantized for the call and torch's GEMM (a CPU without the native library).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from warmboot.kernels import native
from warmboot.kernels.act_quant import ct_codes
from warmboot.kernels.quant_layout import (  # noqa: F401 - the layout's names, re-exported
    COLS,
    FP4,
    FP4_VALUES,
    FP8,
    packed_shapes,
)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``(N, K)`` -> the panel layout."""
    n, k = codes.shape
    panels = (n + COLS - 1) // COLS
    rows = torch.zeros(panels * COLS, k, dtype=torch.uint8, device=codes.device)
    rows[:n] = codes
    by_input = rows.view(panels, COLS, k).transpose(1, 2)  # (P, K, 32)
    if abs(bits) != 4:
        return by_input.contiguous()
    return (by_input[:, 0::2] | (by_input[:, 1::2] << 4)).contiguous()


def pack_groups(t: torch.Tensor) -> torch.Tensor:
    """A per-group tensor ``(N, G)`` -> ``(P, G, 32)``."""
    n, g = t.shape
    panels = (n + COLS - 1) // COLS
    rows = torch.zeros(panels * COLS, g, dtype=t.dtype, device=t.device)
    rows[:n] = t
    return rows.view(panels, COLS, g).transpose(1, 2).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The panel layout -> uint8 codes ``(P * 32, K)``."""
    if abs(bits) == 4:
        pairs = torch.stack((packed & 15, packed >> 4), dim=2)  # (P, K/2, 2, 32)
        packed = pairs.flatten(1, 2)
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])


def unpack_groups(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    n: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense ``(N, K)`` weight, computed in float32 and rounded once to ``dtype``."""
    s = unpack_groups(scales)[:n].float()
    if bits in (FP8, FP4):
        if bits == FP8:
            codes = unpack_codes(packed, 8)[:n].view(torch.float8_e4m3fn).float()
        else:
            table = torch.tensor(FP4_VALUES, device=packed.device)
            codes = table[unpack_codes(packed, 4)[:n].long()]
        w = codes.view(n, -1, group_size) * s.unsqueeze(-1)
        return w.reshape(n, -1).to(dtype)
    codes = unpack_codes(packed, bits)[:n].float()
    z = float(1 << (bits - 1)) if zeros is None else unpack_groups(zeros)[:n].float()
    if zeros is None:
        w = (codes - z).view(n, -1, group_size) * s.unsqueeze(-1)
    else:
        w = (codes.view(n, -1, group_size) - z.unsqueeze(-1)) * s.unsqueeze(-1)
    return w.reshape(n, -1).to(dtype)


@torch.no_grad()
def quantize_rows(w: torch.Tensor, number: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``(N, K)`` weight -> ``number`` (``fp8`` or ``int``: 8-bit) codes ``(N, K)``
    and float32 scales ``(N, 1)``, as llm-compressor quantizes (``act_quant.ct_codes``:
    ``s = amax / 448`` or ``amax / 127.5`` per row, float32's eps where a row is zero)."""
    fp8 = number == "fp8"
    q, scale = ct_codes(w.float(), "fp8" if fp8 else "int8")
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else (q + 128).to(torch.uint8)
    return codes, scale


def quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    if perm is not None:
        x = x.index_select(-1, perm)
    x = padded_input(x, packed, bits)
    args = (x, packed, scales, zeros, bias, out_features, bits, group_size)
    if _native(x):
        return torch.ops.warmboot_cpu.quant_linear(*args)
    if x.is_cuda:
        from warmboot.kernels.triton_quant import triton_quant_linear

        return triton_quant_linear(*args)
    w = dequantize(packed, scales, zeros, bits, group_size, out_features, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def padded_input(x: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` with zero inputs up to the codes' (a partial last group is stored whole, its
    extra codes weights of 0)."""
    k = packed.shape[1] * 8 // abs(bits)
    return x if x.shape[-1] == k else F.pad(x, (0, k - x.shape[-1]))


def runs_native(x: torch.Tensor) -> bool:
    """Whether ``x``'s quantized linears run ``warmboot_cpu::quant_linear`` (fixed for an
    engine's device and dtype: a layer without an input order calls it itself, sparing this
    op's Python, ~4 us of a decode row's ~20)."""
    return _native(x)


def runs_native_i8(x: torch.Tensor) -> bool:
    """Whether ``x``'s W8A8 int8 linears run ``warmboot_cpu::quant_linear_i8`` (int8 rows
    against 8-bit codes with a scale per channel, the products summed in int32; the int8 dot
    products, AVX-512 VNNI's ``vpdpbusd``, take 4 products a lane where BF16's take 2: ~1.9x
    ``quant_linear`` from 8 rows)."""
    if not _native(x):
        return False
    if "i8" not in _NATIVE:
        _NATIVE["i8"] = hasattr(torch.ops.warmboot_cpu, "quant_linear_i8")
    return _NATIVE["i8"]


def _native(x: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if _NATIVE.get("op") is None:
        if not native.ready():
            return False
        _NATIVE["op"] = hasattr(torch.ops.warmboot_cpu, "quant_linear")
    return _NATIVE["op"]


_NATIVE: dict[str, bool] = {}

# NOTE: on a Library, as step_ops' per-layer ops (custom_op's wrapper costs ~12 us a call)
_LIB = torch.library.Library("warmboot", "FRAGMENT")
_LIB.define(
    "quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? perm, "
    "Tensor? bias, int out_features, int bits, int group_size) -> Tensor"
)
_LIB.impl("quant_linear", quant_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("warmboot::quant_linear")
def _(x, packed, scales, zeros, perm, bias, out_features, bits, group_size):
    return x.new_empty((*x.shape[:-1], out_features))
