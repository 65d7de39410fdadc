"""Tiny weight-only quantized checkpoints in the on-disk layouts real tools write, plus a dense
reference checkpoint whose weights are exactly the dequantized values: transformers run on the
reference directory is the fp32 reference for the quantized model.

Layouts, as read in the tools' code (``u`` = unsigned code in [0, 2**bits), ``z`` = unsigned
zero point, dequantized weight = (u - z) * scale, computed here in float64 then cast):

- ``ct-pack``: compressed-tensors 0.20 ``pack-quantized`` (compressors/pack_quantized/helpers.py
  ``pack_to_int32``): the signed int8 value ``u - 2**(bits-1)`` is offset back to ``u`` and packed
  32/bits per int32 along the input dim, element k at bits [k*bits, (k+1)*bits), zero-padded to
  whole words. ``weight_packed`` int32 (out, ceil(in*bits/32)), ``weight_scale`` (out, groups) in
  the model dtype (lifecycle/initialize.py), ``weight_shape`` int64 [out, in]; asymmetric adds
  ``weight_zero_point`` = signed ``z - 2**(bits-1)`` packed the same way along the OUTPUT dim
  (``packed_dim=0``): int32 (ceil(out*bits/32), groups). Symmetric schemes store no zero point.
- ``ct-int``: ``int-quantized`` (compressors/naive_quantized/base.py): ``weight`` int8 signed
  values, ``weight_scale`` (out, groups), asymmetric adds int8 ``weight_zero_point``.
- ``gptq``: GPTQ v1 (``checkpoint_format: gptq``; GPTQModel nn_modules/qlinear ``pack_original``,
  utils/model.py ``convert_gptq_v2_to_v1_format_module``): ``qweight`` int32 (in*bits/32, out)
  packed along the input dim low bits first, ``qzeros`` int32 (groups, out*bits/32) holding
  ``z - 1`` packed along the output dim, ``scales`` fp16 (groups, out), ``g_idx`` int32 (in,).
  The tools subtract 1 word-wise (``qzeros -= 0x11111111``), which borrows across fields when
  z = 0; a field-wise reader then disagrees, so this writer keeps z >= 1 (its codes are still
  exactly what the file says). Symmetric: z = 2**(bits-1).
- ``awq``: AutoAWQ GEMM (awq/modules/linear/gemm.py ``from_linear``): ``qweight`` int32
  (in, out/8) and ``qzeros`` int32 (in/group, out/8) packed along the output dim, nibble i of a
  word holding channel ``8*word + AWQ_ORDER[i]``; ``scales`` fp16 (in/group, out).

GPTQ/AWQ save the biases of quantized linears in fp16 (both ``from_linear``/``pack`` ``.half()``
them); the reference then holds those fp16 values. Other tensors keep the dense dtype.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("ct-pack", "ct-int", "gptq", "awq")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
CT_VERSION = "0.20.0"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class Quantized:
    """One linear's round-to-nearest quantization (all in float64/int64 for exactness)."""

    codes: torch.Tensor  # (out, in) unsigned codes in [0, 2**bits)
    scale: torch.Tensor  # (out, groups), each value exactly representable in the stored dtype
    zero: torch.Tensor  # (out, groups) unsigned zero points
    g_idx: torch.Tensor  # (in,) group of each input channel

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx
        return (self.codes - self.zero[:, g]).double() * self.scale[:, g]


def group_index(
    in_features: int, group_size: int | None, perm: torch.Tensor | None
) -> torch.Tensor:
    """The group of each input channel; with ``perm`` (GPTQ desc_act), g_idx[perm[i]] = i // gs."""
    if group_size is None:
        return torch.zeros(in_features, dtype=torch.int64)
    order = torch.arange(in_features) // group_size
    if perm is None:
        return order
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = order
    return g_idx


def quantize_rtn(
    weight: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    sym: bool,
    scale_dtype: torch.dtype,
    min_zero: int = 0,
) -> Quantized:
    """Min/max round-to-nearest per (row, group), the range always holding 0 (as the tools do).

    Symmetric: z = 2**(bits-1) and scale = max(-min / 2**(bits-1), max / (2**(bits-1) - 1)), the
    tightest grid over [min, max]: the extreme of each group lands on code 0 or 2**bits - 1, so
    both ends of the range occur. Asymmetric: scale = (max - min) / (2**bits - 1), z = round(-min
    / scale). The scale is rounded to its stored dtype before the codes are computed.
    """
    w = weight.double()
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    maxq, half = 2**bits - 1, 2 ** (bits - 1)
    scale = torch.maximum(-lo / half, hi / (half - 1)) if sym else (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).double()
    if not (scale > 0).all() or not scale.isfinite().all():
        raise ValueError("a scale is not representable in its stored dtype")
    if sym:
        zero = torch.full_like(scale, half, dtype=torch.int64)
    else:
        zero = torch.round(-lo / scale).clamp(min_zero, maxq).to(torch.int64)
    codes = torch.round(w / scale[:, g_idx]) + zero[:, g_idx]
    return Quantized(codes.clamp(0, maxq).to(torch.int64), scale, zero, g_idx)


def pack_rows(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned codes along the last dim, 32/bits per int32 word, element k of a word at
    bits [k*bits, (k+1)*bits), zero-padded to whole words; ``order[k]`` picks which element of
    the word's run goes to field k (AWQ's interleave)."""
    per = 32 // bits
    u = torch.nn.functional.pad(codes.to(torch.int64), (0, (-codes.shape[-1]) % per))
    u = u.reshape(*u.shape[:-1], -1, per)
    if order is not None:
        u = u[..., list(order)]
    words = (u << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _encode_ct_pack(q: Quantized, bits: int, sym: bool, dtype: torch.dtype) -> dict:
    out = {
        "weight_packed": pack_rows(q.codes, bits),
        "weight_scale": q.scale.to(dtype),
        "weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int64),
    }
    if not sym:
        out["weight_zero_point"] = pack_rows(q.zero.T, bits).T.contiguous()
    return out


def _encode_ct_int(q: Quantized, bits: int, sym: bool, dtype: torch.dtype) -> dict:
    half = 2 ** (bits - 1)
    out = {"weight": (q.codes - half).to(torch.int8), "weight_scale": q.scale.to(dtype)}
    if not sym:
        out["weight_zero_point"] = (q.zero - half).to(torch.int8)
    return out


def _encode_gptq(q: Quantized, bits: int, sym: bool, dtype: torch.dtype) -> dict:
    return {
        "qweight": pack_rows(q.codes, bits).T.contiguous(),
        "qzeros": pack_rows((q.zero - 1).T, bits),  # v1: zero point minus one
        "scales": q.scale.T.to(torch.float16).contiguous(),
        "g_idx": q.g_idx.to(torch.int32),
    }


def _encode_awq(q: Quantized, bits: int, sym: bool, dtype: torch.dtype) -> dict:
    return {
        "qweight": pack_rows(q.codes.T, bits, AWQ_ORDER),
        "qzeros": pack_rows(q.zero.T, bits, AWQ_ORDER),
        "scales": q.scale.T.to(torch.float16).contiguous(),
    }


ENCODERS = {
    "ct-pack": _encode_ct_pack,
    "ct-int": _encode_ct_int,
    "gptq": _encode_gptq,
    "awq": _encode_awq,
}


def ct_quantization_config(fmt: str, bits: int, group_size: int | None, sym: bool, ignore) -> dict:
    """``quantization_config`` as compressed-tensors 0.20's ``ModelCompressor.update_config``
    writes it for a weight-only int scheme on ``Linear`` (unset optional fields omitted)."""
    name = {"ct-pack": "pack-quantized", "ct-int": "int-quantized"}[fmt]
    weights = {
        "dynamic": False,
        "group_size": group_size,
        "num_bits": bits,
        "strategy": "group" if group_size else "channel",
        "symmetric": sym,
        "type": "int",
    }
    group = {"format": name, "input_activations": None, "output_activations": None}
    return ct_config_envelope(group | {"targets": ["Linear"], "weights": weights}, name, ignore)


def ct_config_envelope(group: dict, name: str, ignore) -> dict:
    """compressed-tensors' ``quantization_config`` around its one config group."""
    return {
        "config_groups": {"group_0": group},
        "format": name,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def gptq_quantization_config(bits, group_size, sym, act_order, lm_head, skipped) -> dict:
    """GPTQModel's ``QuantizeConfig.to_dict`` keys (its ``meta`` cut to a few fields); modules
    left dense go in ``dynamic`` as negative ``-:`` regexes, as GPTQModel expresses them."""
    config = {
        "bits": bits,
        "checkpoint_format": "gptq",
        "desc_act": act_order,
        "format": "gptq",
        "group_size": group_size or -1,
        "lm_head": lm_head,
        "meta": {
            "quantizer": ["warmboot-tests:1"],
            "static_groups": False,
            "true_sequential": True,
        },
        "method": "gptq",
        "pack_dtype": "int32",
        "quant_method": "gptq",
        "sym": sym,
    }
    if skipped:
        config["dynamic"] = {f"-:^{re.escape(name)}$": {} for name in skipped}
    return config


def awq_quantization_config(bits: int, group_size: int, skipped) -> dict:
    """AutoAWQ's ``AwqConfig.to_transformers_dict`` (awq/models/_config.py)."""
    return {
        "bits": bits,
        "group_size": group_size,
        "modules_to_not_convert": list(skipped) or None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }


def is_ignored(module: str, ignore) -> bool:
    """compressed-tensors' ``match_name``: an exact name, or ``re:`` + a regex (``re.match``)."""
    return any(
        re.match(entry[3:], module) is not None if entry.startswith("re:") else entry == module
        for entry in ignore
    )


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight")
        and tensor.ndim == 2
        and (module == "lm_head" or module.rsplit(".", 1)[-1] in LINEAR_NAMES)
    )


def _check_shape(fmt: str, bits: int, group_size: int | None, out_f: int, in_f: int) -> None:
    per = 32 // bits
    if fmt == "gptq":
        ok = in_f % per == 0 and out_f % per == 0
    else:
        ok = group_size is None or in_f % group_size == 0
        ok = ok and (fmt != "awq" or out_f % 8 == 0)
    if not ok:
        raise ValueError(f"{fmt} cannot hold a ({out_f}, {in_f}) linear with group {group_size}")


def _check_args(fmt: str, bits: int, group_size: int | None, act_order: bool) -> None:
    allowed = {"ct-pack": (4, 8), "ct-int": (8,), "gptq": (4, 8), "awq": (4,)}
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if bits not in allowed[fmt]:
        raise ValueError(f"{fmt} supports bits in {allowed[fmt]}, not {bits}")
    if act_order and fmt != "gptq":
        raise ValueError("act_order (desc_act) is a GPTQ layout feature")
    if fmt == "awq" and group_size is None:
        raise ValueError("AWQ GEMM is always grouped")


def _input_gen(module: str, seed: int) -> torch.Generator:
    """act_order's permutation follows the Hessian of a linear's input, so linears that read
    the same input (q/k/v, gate/up) share it, as GPTQ's desc_act gives them."""
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    prefix, _, leaf = module.rpartition(".")
    key = f"{prefix}.{shared.get(leaf, leaf)}"
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def _quantize(fmt, weight, bits, group_size, sym, act_order, gen) -> Quantized:
    out_f, in_f = weight.shape
    _check_shape(fmt, bits, group_size, out_f, in_f)
    perm = torch.randperm(in_f, generator=gen) if act_order else None
    g_idx = group_index(in_f, group_size, perm)
    scale_dtype = torch.float16 if fmt in ("gptq", "awq") else weight.dtype
    return quantize_rtn(weight, g_idx, bits, sym, scale_dtype, 1 if fmt == "gptq" else 0)


def _quant_config(fmt, bits, group_size, sym, act_order, ignore, names, skipped) -> dict:
    if fmt.startswith("ct-"):
        return ct_quantization_config(fmt, bits, group_size, sym, ignore)
    decoder_skips = [n for n in skipped if n != "lm_head"]
    if fmt == "gptq":
        lm_head = "lm_head" in names
        return gptq_quantization_config(bits, group_size, sym, act_order, lm_head, decoder_skips)
    if "lm_head" in names:
        raise ValueError("AutoAWQ never quantizes lm_head: keep it in ignore")
    return awq_quantization_config(bits, group_size, decoder_skips)


def _write_dir(dense_dir: Path, dst: Path, tensors: dict, quant_config: dict | None) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in dense_dir.iterdir():
        if path.is_file() and path.name != WEIGHTS_NAME:
            shutil.copyfile(path, dst / path.name)
    if quant_config is not None:
        config = json.loads((dense_dir / "config.json").read_text())
        config["quantization_config"] = quant_config
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(dst / WEIGHTS_NAME), metadata={"format": "pt"})


def write_quantized(
    dense_dir: Path,
    out_dir: Path,
    ref_dir: Path,
    fmt: str,
    *,
    bits: int = 4,
    group_size: int | None = 32,
    sym: bool = True,
    act_order: bool = False,
    ignore: tuple[str, ...] = ("lm_head",),
    seed: int = 0,
) -> None:
    """Quantize every linear of ``dense_dir`` (q/k/v/o, gate/up/down, and lm_head unless
    ignored) into ``out_dir`` in format ``fmt``; write the dequantized reference to ``ref_dir``.

    ``group_size=None`` is per output channel; ``seed`` only drives act_order's permutations.
    ``ignore`` entries match as compressed-tensors' do (exact module name or ``re:`` regex);
    GPTQ lists the skipped decoder modules in ``dynamic``, AWQ in ``modules_to_not_convert``.
    AWQ always stores zero points (``zero_point: true``); ``sym=True`` puts the symmetric grid
    (z = 8) in them. Shapes a layout cannot hold raise ``ValueError``.
    """
    dense_dir, out_dir, ref_dir = Path(dense_dir), Path(out_dir), Path(ref_dir)
    _check_args(fmt, bits, group_size, act_order)
    if not (dense_dir / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{dense_dir / WEIGHTS_NAME} (one unsharded file expected)")
    tensors = load_file(str(dense_dir / WEIGHTS_NAME))
    out, ref, names, skipped = dict(tensors), dict(tensors), [], []
    for name in sorted(tensors):
        tensor, module = tensors[name], name.removesuffix(".weight")
        if not _is_linear(name, tensor):
            continue
        if is_ignored(module, ignore):
            skipped.append(module)
            continue
        names.append(module)
        q = _quantize(fmt, tensor, bits, group_size, sym, act_order, _input_gen(module, seed))
        ref[name] = q.dequantize().to(tensor.dtype)
        del out[name]
        encoded = ENCODERS[fmt](q, bits, sym, tensor.dtype)
        out.update({f"{module}.{key}": value for key, value in encoded.items()})
        bias = tensors.get(f"{module}.bias")
        if bias is not None and fmt in ("gptq", "awq"):
            out[f"{module}.bias"] = bias.to(torch.float16)
            ref[f"{module}.bias"] = out[f"{module}.bias"].to(bias.dtype)
    if not names:
        raise ValueError(f"no linear of {dense_dir} is left to quantize (ignore={ignore})")
    config = _quant_config(fmt, bits, group_size, sym, act_order, ignore, names, skipped)
    _write_dir(dense_dir, out_dir, out, config)
    _write_dir(dense_dir, ref_dir, ref, None)
