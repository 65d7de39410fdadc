"""Each format's tensors of one quantized linear -> one layout (``QuantScheme``'s checkpoint
to what ``QuantMethod`` loads): ``weight`` uint8 codes ``(N, K)`` in ``[0, 2^bits)``,
``weight_scale`` ``(N, G)`` in the checkpoint's dtype, ``weight_zero`` uint8 codes ``(N, G)``
(asymmetric schemes only: a symmetric one's zero is ``2^(bits-1)``), and ``weight_perm``
``(K,)`` where the groups are not consecutive inputs (``g_idx``): the codes come in that order.

The layouts (checked against the libraries' own pack and dequantize code):
- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 ``(N, K*bits/32)``, signed
  values plus ``2^(bits-1)``, packed along K low bits first; asymmetric zero points signed
  the same way, packed along N (``(N*bits/32, G)``); ``weight_shape``; ``weight_g_idx``.
- compressed-tensors ``int-quantized``: ``weight`` int8 ``(N, K)``, zero points int8.
- GPTQ: ``qweight`` int32 ``(K*bits/32, N)`` packed along K; ``qzeros`` int32
  ``(G, N*bits/32)`` packed along N, v1 checkpoints storing zero - 1; ``scales`` ``(G, N)``;
  ``g_idx`` ``(K,)``.
- AWQ (GEMM): ``qweight`` int32 ``(K, N/8)`` and ``qzeros`` ``(G, N/8)`` packed along N with
  output ``order[i]`` in nibble ``i``; ``scales`` ``(G, N)``.
- FP8 (compressed-tensors ``float-quantized``, ``quant_method: fp8``): ``weight`` e4m3
  ``(N, K)``, its bytes the codes; ``weight_scale`` / ``weight_scale_inv`` per tensor, row or
  block (``(ceil(N/bn), K/bk)``, held per row); ``input_scale`` of static activations.
- MXFP4 (GPT-OSS's experts): ``{proj}_blocks`` uint8 ``(E, N, K/32, 16)``, two e2m1 values a
  byte (input ``2j`` in the low nibble), ``{proj}_scales`` uint8 ``(E, N, K/32)``, e8m0
  exponents (scale ``2^(e - 127)``, held exactly in bf16); stacked experts, so the outputs
  are named as ``FusedExperts``' (``{proj}``, ``{proj}_scale``).
"""

from __future__ import annotations

import re

import torch

from warmboot.architectures import UnsupportedModelError
from warmboot.models.quant_config import QuantScheme

LEAVES = {
    "ct-pack": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_zero_point"}),
    "ct-int": ({"weight", "weight_scale"}, {"weight_zero_point", "input_scale"}),
    "ct-float": ({"weight", "weight_scale"}, {"input_scale"}),
    "fp8": ({"weight", "weight_scale_inv"}, set()),
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "mxfp4": ({"blocks", "scales"}, set()),
}
"""Per layout: the leaves a quantized linear must have, and those it may have."""
MARKER = {
    "ct-pack": "weight_packed",
    "ct-int": "weight_scale",
    "ct-float": "weight_scale",
    "fp8": "weight_scale_inv",
    "gptq": "qweight",
    "awq": "qweight",
    "mxfp4": "blocks",
}
"""The leaf whose presence marks a linear as quantized."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


_STACKED_LEAF = re.compile(r"(.+)_(blocks|scales)$")
"""MXFP4's experts: ``{proj}_{leaf}`` (one tensor for every expert)."""


def split_name(scheme: QuantScheme, name: str) -> tuple[str, str]:
    """A checkpoint name -> (the quantized linear's prefix, its leaf)."""
    if scheme.layout == "mxfp4" and (m := _STACKED_LEAF.match(name)):
        return m[1], m[2]
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def joined_name(scheme: QuantScheme, prefix: str, leaf: str) -> str:
    """The name one layout's ``leaf`` of the linear at ``prefix`` takes (stacked experts:
    ``FusedExperts``' own)."""
    if scheme.layout == "mxfp4":
        return prefix + leaf.removeprefix("weight")
    return f"{prefix}.{leaf}"


def leaves(scheme: QuantScheme) -> set[str]:
    required, optional = LEAVES[scheme.layout]
    extra = {"weight_g_idx"} if scheme.layout.startswith("ct") else set()
    return required | optional | extra


def canonical(
    scheme: QuantScheme, prefix: str, t: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One linear's tensors (by leaf) in the one layout (by leaf)."""
    missing = LEAVES[scheme.layout][0] - set(t)
    if missing:
        raise UnsupportedModelError(f"{prefix}: quantized linear lacks {sorted(missing)}")
    convert = {"ct-pack": _ct_pack, "ct-int": _ct_int, "gptq": _gptq, "awq": _awq}
    convert |= {"ct-float": _float, "fp8": _float}
    if scheme.layout == "mxfp4":
        return _mxfp4(prefix, t["blocks"], t["scales"])
    try:
        codes, scale, zero, g_idx = convert[scheme.layout](scheme, prefix, t)
        out = _grouped(scheme, prefix, codes, scale, zero, g_idx)
        if "input_scale" in t:
            out["input_scale"] = t["input_scale"].reshape(1).float()
        return out
    except (RuntimeError, UnsupportedModelError) as e:
        held = ", ".join(f"{leaf} {tuple(v.shape)} {v.dtype}" for leaf, v in sorted(t.items()))
        raise UnsupportedModelError(f"{e} (in the checkpoint: {held})") from None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words -> one code each (int32), along ``dim``, low bits first (or ``order``:
    word bits ``i`` hold element ``order[i]``)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    if order is not None:
        shifts = shifts[torch.tensor([list(order).index(i) for i in range(per)])]
    words = (packed.to(torch.int64) & 0xFFFFFFFF).movedim(dim, -1).unsqueeze(-1)
    codes = (words >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).movedim(-1, dim)


def _ct_pack(scheme, prefix, t):
    n, k = (int(v) for v in t["weight_shape"].tolist())
    codes = unpack_int32(_int(prefix, t, "weight_packed"), scheme.bits, 1)[:, :k]
    zero = None
    if not scheme.symmetric:
        packed = _int(prefix, t, "weight_zero_point")
        zero = unpack_int32(packed, scheme.bits, 0)[:n] if packed.dtype == torch.int32 else None
        if zero is None:  # NOTE: older exports keep them unpacked and signed
            zero = packed.to(torch.int32) + (1 << (scheme.bits - 1))
    return _rows(prefix, codes, n), t["weight_scale"], zero, t.get("weight_g_idx")


def _ct_int(scheme, prefix, t):
    weight = t["weight"]
    if weight.dtype != torch.int8:
        raise UnsupportedModelError(f"{prefix}.weight is {weight.dtype}, int-quantized is int8")
    offset = 1 << (scheme.bits - 1)
    zero = None
    if not scheme.symmetric:
        zero = _int(prefix, t, "weight_zero_point").to(torch.int32) + offset
    return weight.to(torch.int32) + offset, t["weight_scale"], zero, t.get("weight_g_idx")


def _gptq(scheme, prefix, t):
    codes = unpack_int32(_int(prefix, t, "qweight"), scheme.bits, 0).t()
    n = codes.shape[0]
    # NOTE: v1 stores zero - 1 subtracted word-wise (a zero of 0 borrows from the next field),
    # so the one is added back word-wise too
    ones = sum(scheme.zero_offset << s for s in range(0, 32, scheme.bits))
    words = _int(prefix, t, "qzeros").to(torch.int64) + ones
    zero = unpack_int32(words, scheme.bits, 1)[:, :n].t()
    return codes, t["scales"].t(), zero, t.get("g_idx")


def _awq(scheme, prefix, t):
    if scheme.bits != 4:
        raise UnsupportedModelError(f"{prefix}: AWQ GEMM packs 4 bits, not {scheme.bits}")
    codes = unpack_int32(_int(prefix, t, "qweight"), 4, 1, AWQ_ORDER).t()
    zero = unpack_int32(_int(prefix, t, "qzeros"), 4, 1, AWQ_ORDER).t()
    return codes, t["scales"].t(), zero, None


def _float(scheme, prefix, t):
    """FP8 e4m3 weights: the codes are their bits; a scale per tensor, row or block (held
    per row)."""
    weight = t["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedModelError(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn")
    n = weight.shape[0]
    scale = t["weight_scale_inv" if scheme.layout == "fp8" else "weight_scale"]
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    elif scheme.block_rows:
        scale = scale.repeat_interleave(scheme.block_rows, dim=0)[:n]
    return weight.view(torch.uint8), scale, None, None


def _mxfp4(prefix: str, blocks: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked MXFP4 experts -> codes ``(E, N, K)`` (one nibble each) and bf16 scales."""
    shape = tuple(blocks.shape)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or len(shape) != 4:
        raise UnsupportedModelError(
            f"{prefix}: MXFP4 wants uint8 blocks (E, N, K/32, 16) and scales (E, N, K/32), "
            f"got {blocks.dtype} {shape} and {scales.dtype} {tuple(scales.shape)}"
        )
    if shape[3] != 16 or tuple(scales.shape) != shape[:3]:
        raise UnsupportedModelError(
            f"{prefix}: MXFP4 blocks {shape} and scales {tuple(scales.shape)} do not match "
            "(16 bytes, 32 values, a scale)"
        )
    if bool((scales == 255).any()):
        raise UnsupportedModelError(f"{prefix}: an MXFP4 scale is e8m0's NaN (255)")
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(2)  # (E, N, K)
    scale = torch.exp2(scales.to(torch.float32) - 127).to(torch.bfloat16)  # NOTE: exact
    return {"weight": codes.contiguous(), "weight_scale": scale}


def _int(prefix: str, t: dict[str, torch.Tensor], leaf: str) -> torch.Tensor:
    tensor = t.get(leaf)
    if tensor is None:
        raise UnsupportedModelError(f"{prefix}: quantized linear lacks {leaf}")
    if tensor.is_floating_point():
        raise UnsupportedModelError(f"{prefix}.{leaf} is {tensor.dtype}, not an integer tensor")
    return tensor


def _rows(prefix: str, codes: torch.Tensor, n: int) -> torch.Tensor:
    if codes.shape[0] != n:
        raise UnsupportedModelError(
            f"{prefix}.weight_packed has {codes.shape[0]} rows, weight_shape says {n}"
        )
    return codes


def _grouped(scheme, prefix, codes, scale, zero, g_idx) -> dict[str, torch.Tensor]:
    """Shapes checked, groups made consecutive, the zero point dropped where symmetric."""
    n, k = codes.shape
    size = scheme.group_size or k
    if k % size and not partial_groups(scheme):
        raise UnsupportedModelError(f"{prefix}: {k} inputs are not whole groups of {size}")
    groups = -(-k // size)  # NOTE: a partial last group (GPTQ's g_idx on 576 inputs, g128)
    scale = scale.reshape(n, -1) if scale.dim() == 1 else scale
    if tuple(scale.shape) != (n, groups) or not scale.is_floating_point():
        raise UnsupportedModelError(
            f"{prefix}: scale is {scale.dtype} {tuple(scale.shape)}, expected a float "
            f"({n}, {groups}) for {scheme.describe()}"
        )
    out = {"weight_scale": scale.contiguous()}
    perm = _perm(prefix, g_idx, k, size)
    if perm is not None and not scheme.act_order:
        raise UnsupportedModelError(f"{prefix}: g_idx is out of order, but act-order is off")
    if scheme.act_order:
        perm = torch.arange(k) if perm is None else perm
        codes = codes[:, perm]
        out["weight_perm"] = perm
    if zero is not None:
        zero = zero.reshape(n, -1) if zero.dim() == 1 else zero
        if tuple(zero.shape) != (n, groups):
            raise UnsupportedModelError(
                f"{prefix}: zero points are {tuple(zero.shape)}, expected ({n}, {groups})"
            )
        if scheme.symmetric:
            if bool((zero != 1 << (scheme.bits - 1)).any()):
                raise UnsupportedModelError(
                    f"{prefix}: sym is set but the zero points are not {1 << (scheme.bits - 1)}"
                )
        else:
            out["weight_zero"] = zero.to(torch.uint8).contiguous()
    if scheme.number == "int" and bool((codes < 0).any() | (codes >= 1 << scheme.bits).any()):
        raise UnsupportedModelError(f"{prefix}: codes outside {scheme.bits} bits")
    out["weight"] = _padded(codes, groups * size, zero, scheme.bits).to(torch.uint8).contiguous()
    return out


def partial_groups(scheme: QuantScheme) -> bool:
    """Whether a last group may be partial: integer weights with full-precision inputs (the
    codes are padded with zero-point codes, weights of exactly 0, and the input with zeros)."""
    return scheme.number == "int" and scheme.act is None


def _padded(codes: torch.Tensor, kp: int, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Codes ``(N, K)`` -> ``(N, kp)``, the new inputs at the last group's zero point."""
    n, k = codes.shape
    if kp == k:
        return codes
    fill = torch.full((n, 1), 1 << (bits - 1)) if zero is None else zero.reshape(n, -1)[:, -1:]
    return torch.cat((codes, fill.to(codes.dtype).expand(n, kp - k)), dim=1)


def _perm(prefix: str, g_idx: torch.Tensor | None, k: int, size: int) -> torch.Tensor | None:
    """Input order that makes ``g_idx``'s groups consecutive; None where they already are."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    expected = torch.arange(k) // size
    if g_idx.shape != (k,):
        raise UnsupportedModelError(f"{prefix}: g_idx is {tuple(g_idx.shape)}, expected ({k},)")
    if torch.equal(g_idx, expected):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], expected):
        raise UnsupportedModelError(f"{prefix}: g_idx groups are not {size} inputs each")
    return perm
