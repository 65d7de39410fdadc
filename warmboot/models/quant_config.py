"""A checkpoint's quantization, read from its config (torch-free: ``preflight`` runs it in the
server process): which of the served weight-only schemes it is, or a refusal naming the field.

Served: integer weights of 4 or 8 bits, per output channel or in groups along the input,
symmetric or with zero points, activations in full precision (W4A16, W8A16), as
compressed-tensors (``pack-quantized``, ``int-quantized``), GPTQ (with ``desc_act``'s
``g_idx``) and AWQ (GEMM) store them. Every such weight becomes one layout
(``models.quant_formats``): codes, a scale per group, a zero-point code per group where not
symmetric. Schemes that quantize activations (W8A8, FP8) or use other number formats
(FP8, MXFP4, NVFP4) are refused by name: served approximately they would give other tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmboot.models.registry import UnsupportedModelError

METHODS = ("compressed-tensors", "gptq", "awq")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
"""vLLM's names for the same checkpoints run by other kernels (``--quantization``)."""
NOT_SERVED = {
    "fp8": "FP8 weights with FP8 activations",
    "mxfp4": "MXFP4 (GPT-OSS's experts)",
    "bitsandbytes": "bitsandbytes",
    "gguf": "GGUF",
    "hqq": "HQQ",
    "eetq": "EETQ",
    "fbgemm_fp8": "FBGEMM FP8",
    "modelopt": "ModelOpt FP8/NVFP4",
    "quark": "Quark",
    "torchao": "torchao",
    "bitnet": "BitNet",
}


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only integer scheme for every quantized linear of a checkpoint."""

    method: str
    """``compressed-tensors``, ``gptq`` or ``awq``."""
    layout: str
    """How the tensors lie: ``ct-pack``, ``ct-int``, ``gptq``, ``awq``."""
    bits: int
    group_size: int | None
    """Inputs per scale; None: one scale per output channel."""
    symmetric: bool
    zero_offset: int = 0
    """Added to stored zero points (GPTQ's v1 checkpoints store zero - 1)."""
    act_order: bool = False
    """Groups given by ``g_idx`` (GPTQ's ``desc_act``, compressed-tensors' ``actorder:
    group``): the GEMM reads its inputs in their order (``weight_perm``)."""

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per channel"
        order = ", act-order" if self.act_order else ""
        return (
            f"{self.method} W{self.bits}A16 {group}, {'sym' if self.symmetric else 'asym'}{order}"
        )


def requested_method(quantization: str | None) -> str | None:
    """``LLM(quantization=)`` / ``--quantization``: None or ``auto`` (the config decides), a
    served method (aliases resolved), or a refusal."""
    if quantization in (None, "", "auto"):
        return None
    name = ALIASES.get(quantization.lower(), quantization.lower())
    if name in METHODS:
        return name
    if name in ("int8", "fp8"):
        raise UnsupportedModelError(
            f"quantization {quantization!r}: quantizing a full-precision checkpoint at load is "
            "not served yet; serve a checkpoint quantized by its tool (compressed-tensors, "
            "GPTQ or AWQ)"
        )
    raise UnsupportedModelError(
        f"quantization {quantization!r} is not one of auto, {', '.join(METHODS)}"
        f"{', ' + ', '.join(ALIASES) if ALIASES else ''}"
    )


def quant_scheme(
    model_dir: Path, cfg: dict[str, Any] | Any, quantization: str | None = None
) -> QuantScheme | None:
    """The checkpoint's scheme (None: full precision), checked against ``quantization``."""
    raw = cfg.get("quantization_config")
    if raw is None and (model_dir / "quantize_config.json").is_file():
        raw = _read_json(model_dir / "quantize_config.json")  # NOTE: AutoGPTQ's own file
        raw.setdefault("quant_method", "gptq")
    wanted = requested_method(quantization)
    if raw is None:
        if wanted is not None:
            raise UnsupportedModelError(
                f"{model_dir}: quantization {quantization!r} was asked for, but the checkpoint "
                "has no quantization_config (it is full precision)"
            )
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{model_dir}: quantization_config is not an object")
    method = str(raw.get("quant_method", "unknown")).lower()
    if method in NOT_SERVED or method not in METHODS:
        what = f" ({NOT_SERVED[method]})" if method in NOT_SERVED else ""
        raise UnsupportedModelError(
            f"{model_dir}: quant_method {method!r}{what} is not served (served: weight-only "
            f"int4/int8 as {', '.join(METHODS)}); serve the full-precision weights"
        )
    if wanted is not None and wanted != method:
        raise UnsupportedModelError(
            f"{model_dir}: quantization {quantization!r} contradicts the checkpoint's "
            f"quant_method {method!r}"
        )
    parse = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}[method]
    return parse(raw)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} is not a JSON object")
    return data


def _refuse(field: str, value: object, served: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"quantization_config.{field} = {value!r} is not served ({served})"
    )


def _bits(field: str, bits: object) -> int:
    if bits not in (4, 8):
        raise _refuse(field, bits, "4 or 8 bits")
    return int(bits)


def _group(field: str, group: object, allow_channel: int | None) -> int | None:
    if group == allow_channel or group is None:
        return None
    if not isinstance(group, int) or group < 2 or group % 2:
        raise _refuse(field, group, "an even group size, or per channel")
    return group


def _gptq(raw: dict) -> QuantScheme:
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq, gptq_v2")
    if raw.get("dynamic"):
        raise _refuse("dynamic", "per-module overrides", "one scheme for every module")
    return QuantScheme(
        method="gptq",
        layout="gptq",
        bits=_bits("bits", raw.get("bits")),
        group_size=_group("group_size", raw.get("group_size", -1), -1),
        symmetric=bool(raw.get("sym", True)),
        zero_offset=1 if fmt == "gptq" else 0,
        act_order=bool(raw.get("desc_act", False)),
    )


def _awq(raw: dict) -> QuantScheme:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", version, "gemm")
    if not raw.get("zero_point", True):
        raise _refuse("zero_point", False, "AWQ with zero points")
    return QuantScheme(
        method="awq",
        layout="awq",
        bits=_bits("bits", raw.get("bits", raw.get("w_bit"))),
        group_size=_group("group_size", raw.get("group_size", raw.get("q_group_size")), -1),
        symmetric=False,
    )


def _compressed_tensors(raw: dict) -> QuantScheme:
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "compressed")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(field):
            raise _refuse(field, "set", "none")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", f"{len(groups)} groups", "exactly one scheme")
    name, group = next(iter(groups.items()))
    return _ct_group(f"config_groups.{name}", group, raw.get("format"))


def _ct_group(where: str, group: dict, top_format: object) -> QuantScheme:
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{where}.targets", targets, '["Linear"]')
    for side in ("input_activations", "output_activations"):
        if group.get(side) is not None:
            raise _refuse(f"{where}.{side}", "quantized", "weight-only schemes (W4A16, W8A16)")
    w = group.get("weights") or {}
    if w.get("type", "int") != "int":
        raise _refuse(f"{where}.weights.type", w.get("type"), "int")
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", True, "static weights")
    fmt = group.get("format") or top_format
    layout = {"pack-quantized": "ct-pack", "int-quantized": "ct-int"}.get(str(fmt))
    if layout is None:
        raise _refuse("format", fmt, "pack-quantized, int-quantized")
    bits = _bits(f"{where}.weights.num_bits", w.get("num_bits"))
    if layout == "ct-int" and bits != 8:
        raise _refuse(f"{where}.weights.num_bits", bits, "8 for int-quantized")
    strategy = w.get("strategy")
    if strategy not in ("channel", "group"):
        raise _refuse(f"{where}.weights.strategy", strategy, "channel, group")
    size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and size is None:
        raise _refuse(f"{where}.weights.group_size", None, "a group size")
    return QuantScheme(
        method="compressed-tensors",
        layout=layout,
        bits=bits,
        group_size=_group(f"{where}.weights.group_size", size, None),
        symmetric=bool(w.get("symmetric", True)),
        act_order=w.get("actorder") == "group",
    )
