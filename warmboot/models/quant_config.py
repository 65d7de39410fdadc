"""A checkpoint's quantization, read from its config (torch-free: ``preflight`` runs it in the
server process): which of the served weight-only schemes it is, or a refusal naming the field.

Served: integer weights of 4 or 8 bits, per output channel or in groups along the input,
symmetric or with zero points, activations in full precision (W4A16, W8A16), as
compressed-tensors (``pack-quantized``, ``int-quantized``), GPTQ (with ``desc_act``'s
``g_idx``) and AWQ (GEMM) store them; and 8-bit weights whose activations are quantized too
(``ActQuant``): compressed-tensors' W8A8 int8 and FP8 (``float-quantized``: per tensor,
channel or block), and ``quant_method: fp8`` with 128x128 blocks (DeepSeek-V3, Qwen3-FP8);
and GPT-OSS's MXFP4 experts (``quant_method: mxfp4``: e2m1 values, a power-of-two scale per
32 inputs). Every weight becomes one layout (``models.quant_formats``): 8- or 4-bit codes
(integers, FP8 e4m3's bits or FP4 e2m1's), a scale per row and group of inputs, a zero-point
code per group where not symmetric. Other number formats (NVFP4) and other options are
refused by name: served approximately they would give other tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmboot.architectures import UnsupportedModelError

METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "mxfp4")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
"""vLLM's names for the same checkpoints run by other kernels (``--quantization``)."""
NOT_SERVED = {
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
class ActQuant:
    """How a linear's input is quantized (and dequantized) before its GEMM, as the format's
    runtime does: ``number`` ``int8`` or ``fp8``; ``strategy`` ``token`` (a scale per row),
    ``group`` (per row and ``group_size`` inputs) or ``tensor`` (``static``: the checkpoint's
    ``input_scale``); ``rule``: ``ct`` (compressed-tensors' qparams) or ``kernel`` (the FP8
    block kernels': amax / 448), ``ue8m0``: scales rounded up to powers of two."""

    number: str
    strategy: str
    group_size: int | None = None
    static: bool = False
    rule: str = "ct"
    ue8m0: bool = False


@dataclass(frozen=True)
class QuantScheme:
    """One scheme for every quantized linear of a checkpoint."""

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
    number: str = "int"
    """The codes: ``int`` (``(u - z) * s``), ``fp8`` (e4m3's bits: ``fp8(u) * s``) or ``fp4``
    (e2m1's)."""
    block_rows: int | None = None
    """Block scales: ``block_rows`` rows share each group's scale (held per row)."""
    act: ActQuant | None = None
    online: bool = False
    """Quantized at load from full-precision weights (``LLM(quantization="fp8" / "int8")``)."""

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per channel"
        if self.block_rows:
            group = f"block {self.block_rows}x{self.group_size}"
        order = ", act-order" if self.act_order else ""
        w = f"W{self.bits}" if self.number == "int" else f"{self.number.upper()} W{self.bits}"
        a = "A16" if self.act is None else f"A8 ({self.act.number} per {self.act.strategy})"
        sym = "sym" if self.symmetric else "asym"
        return f"{self.method} {w}{a} {group}, {sym}{order}"


def requested_method(quantization: str | None) -> str | None:
    """``LLM(quantization=)`` / ``--quantization``: None or ``auto`` (the config decides), a
    served method (aliases resolved), or a refusal."""
    if quantization in (None, "", "auto"):
        return None
    name = ALIASES.get(quantization.lower(), quantization.lower())
    if name in METHODS or name in ONLINE:
        return name
    raise UnsupportedModelError(
        f"quantization {quantization!r} is not one of auto, {', '.join(METHODS)}, int8, "
        f"{', '.join(ALIASES)}"
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
        if wanted is not None and wanted not in ONLINE:
            raise UnsupportedModelError(
                f"{model_dir}: quantization {quantization!r} was asked for, but the checkpoint "
                f"has no quantization_config (it is full precision); at load it can be "
                f"quantized to {' or '.join(ONLINE)}"
            )
        return ONLINE.get(wanted)
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{model_dir}: quantization_config is not an object")
    method = str(raw.get("quant_method", "unknown")).lower()
    if method in NOT_SERVED or method not in METHODS:
        what = f" ({NOT_SERVED[method]})" if method in NOT_SERVED else ""
        raise UnsupportedModelError(
            f"{model_dir}: quant_method {method!r}{what} is not served (served: "
            f"{', '.join(METHODS)}); serve the full-precision weights"
        )
    if wanted == "int8" or (wanted is not None and wanted != method):
        raise UnsupportedModelError(
            f"{model_dir}: quantization {quantization!r} contradicts the checkpoint's "
            f"quant_method {method!r}"
        )
    parse = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8}
    parse["mxfp4"] = _mxfp4
    return parse[method](raw)


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
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", "quantized", "none")
    w = group.get("weights") or {}
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", True, "static weights")
    fmt = group.get("format") or top_format
    act = _ct_act(f"{where}.input_activations", group.get("input_activations"))
    if w.get("type", "int") == "float":
        return _ct_float(where, w, fmt, act)
    if w.get("type", "int") != "int":
        raise _refuse(f"{where}.weights.type", w.get("type"), "int, float")
    layout = {"pack-quantized": "ct-pack", "int-quantized": "ct-int"}.get(str(fmt))
    if layout is None:
        raise _refuse("format", fmt, "pack-quantized, int-quantized, float-quantized")
    if act is not None and (act.number != "int8" or layout != "ct-int"):
        raise _refuse(f"{where}.input_activations.type", "float", "int with int8 weights")
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
        act=act,
    )


def _ct_act(where: str, a: dict | None) -> ActQuant | None:
    """compressed-tensors' input activations: 8 bits, symmetric; per token or group
    (dynamic) or per tensor (static, ``input_scale``)."""
    if a is None:
        return None
    number = {"int": "int8", "float": "fp8"}.get(a.get("type", "int"))
    if number is None or a.get("num_bits") != 8:
        raise _refuse(where, f"{a.get('type')} {a.get('num_bits')} bits", "int or float, 8 bits")
    if not a.get("symmetric", True):
        raise _refuse(f"{where}.symmetric", False, "symmetric activations")
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    served = {("token", True), ("tensor", False), ("group", True)}
    if (strategy, dynamic) not in served:
        raise _refuse(
            where,
            f"strategy {strategy}, dynamic {dynamic}",
            "dynamic token or group, static tensor",
        )
    size = a.get("group_size") if strategy == "group" else None
    return ActQuant(number, strategy, size, static=not dynamic)


def _ct_float(where: str, w: dict, fmt: object, act: ActQuant | None) -> QuantScheme:
    """compressed-tensors' FP8 weights (``float-quantized``): a scale per tensor, channel or
    block."""
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "float-quantized for float weights")
    if w.get("num_bits") != 8 or not w.get("symmetric", True):
        raise _refuse(f"{where}.weights", f"{w.get('num_bits')} bits", "FP8, symmetric")
    strategy, rows, size = w.get("strategy"), None, None
    if strategy == "block":
        rows, size = _block(f"{where}.weights.block_structure", w.get("block_structure"))
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "tensor, channel, block")
    if act is not None and act.number != "fp8":
        raise _refuse(f"{where}.input_activations.type", "int", "float with FP8 weights")
    return QuantScheme(
        "compressed-tensors", "ct-float", 8, size, True, number="fp8", block_rows=rows, act=act
    )


def _block(field: str, block: object) -> tuple[int, int]:
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise _refuse(field, block, "[rows, inputs]")
    rows, size = block
    _group(field, size, None)
    return rows, size


def _fp8(raw: dict) -> QuantScheme:
    """``quant_method: fp8`` (DeepSeek-V3/R1, Kimi K2, Qwen3-FP8, GLM-4.5-FP8): e4m3 weights,
    ``weight_scale_inv`` per block, activations quantized per token and block of inputs."""
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", raw.get("fmt"), "e4m3")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", raw.get("activation_scheme"), "dynamic")
    rows, size = _block("weight_block_size", raw.get("weight_block_size"))
    scale_fmt = raw.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise _refuse("scale_fmt", scale_fmt, "none, ue8m0")
    act = ActQuant("fp8", "group", size, rule="kernel", ue8m0=scale_fmt == "ue8m0")
    return QuantScheme("fp8", "fp8", 8, size, True, number="fp8", block_rows=rows, act=act)


def _mxfp4(raw: dict) -> QuantScheme:
    """GPT-OSS's experts: e2m1 values two a byte (``*_blocks``), an e8m0 exponent per 32
    inputs (``*_scales``); the rest (``modules_to_not_convert``) in full precision.
    (``dequantize``, transformers' load-time option, changes no value: it is ignored.)"""
    return QuantScheme("mxfp4", "mxfp4", 4, 32, True, number="fp4")


ONLINE = {
    "fp8": QuantScheme(
        "fp8", "online", 8, None, True, number="fp8", act=ActQuant("fp8", "token"), online=True
    ),
    "int8": QuantScheme("int8", "online", 8, None, True, online=True),
}
"""Full-precision checkpoints quantized at load: ``fp8`` as llm-compressor's FP8_DYNAMIC
(e4m3 weights, a scale per row, activations FP8 per token, dynamic; vLLM's online FP8 keeps
one scale per tensor for both); ``int8`` as its W8A16 (weights only, a scale per row)."""
