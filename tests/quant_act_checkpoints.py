"""Tiny checkpoints whose linears quantize their input activations as well as their weights, in
the on-disk layouts the tools write, plus a dense reference: ``ref_dir`` holds the exactly
dequantized weights and ``reference_model`` adds forward pre-hooks that fake-quantize each
quantized linear's input the way the format's runtime does.

Formats (``write_act_quantized(..., fmt, variant=...)``), as read in the tools' code:

- ``ct-w8a8``: compressed-tensors 0.20 ``int-quantized`` (compressors/naive_quantized/base.py):
  ``weight`` int8 (out, in), ``weight_scale`` (out, 1) per channel, symmetric (no zero points,
  ``_remove_symmetric_zp``). ``dynamic`` = preset W8A8: int8 input per token, dynamic; ``static``:
  int8 input per tensor with an ``input_scale`` (1,) tensor.
- ``ct-fp8``: ``float-quantized``: ``weight`` float8_e4m3fn. ``dynamic`` = FP8_DYNAMIC (weights per
  channel, input per token); ``static`` = FP8 (weights and input per tensor, ``weight_scale`` and
  ``input_scale`` of shape (1,)); ``block`` = FP8_BLOCK (128x128 weight blocks, ``weight_scale``
  (ceil(out/128), ceil(in/128)); input per token per group of 128).
- ``fp8-block``: ``quant_method: fp8`` (DeepSeek-V3, Qwen3-FP8): ``weight`` float8_e4m3fn,
  ``weight_scale_inv`` float32 (ceil(out/128), ceil(in/128)), dequantized w = q * scale_inv;
  ``ue8m0`` (DeepSeek-V3.1, ``scale_fmt: ue8m0``) keeps those scales powers of two, still fp32.

Weight scales (llm-compressor: quantization/utils/helpers.py ``calculate_qparams``): amax of each
row / tensor / block (a partial last block: of its valid part) over 127.5 = (127 - -128) / 2
(int8) or 448 (fp8), codes = clamp(round(w / s)) or fp8(clamp(w / s, +-448)). fp8-block follows
transformers' ``Fp8Quantize`` (integrations/finegrained_fp8.py): s = 1 / (448 / amax), codes =
fp8(clamp(w * (448 / amax))); ue8m0: s = 2**ceil(log2(s)), codes = fp8(clamp(w / s)).

Static input scales: ``act_clip`` x amax(|input|) / 127.5 or / 448 over a random batch on the
dense model; q/k/v (and gate/up) read one tensor, so they share it, as llm-compressor's observers
give them. ``act_clip`` < 1 makes the clamp matter.

Partial blocks: compressed-tensors pads weights to whole blocks and DeepSeek's kernels mask the
tail, so the output dim may end in a partial block; the input dim may not (compressed-tensors'
group activations and DeepSeek's ``act_quant`` require in % 128 == 0): refused here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.quant_checkpoints import (
    WEIGHTS_NAME,
    _is_linear,
    _write_dir,
    ct_config_envelope,
    is_ignored,
)

FORMATS = ("ct-w8a8", "ct-fp8", "fp8-block")
VARIANTS = {
    "ct-w8a8": ("dynamic", "static"),
    "ct-fp8": ("dynamic", "static", "block"),
    "fp8-block": ("float", "ue8m0"),
}
# (weight strategy, input strategy) of each compressed-tensors variant (quant_scheme.py presets)
CT_STRATEGIES = {
    ("ct-w8a8", "dynamic"): ("channel", "token"),
    ("ct-w8a8", "static"): ("channel", "tensor"),
    ("ct-fp8", "dynamic"): ("channel", "token"),
    ("ct-fp8", "static"): ("tensor", "tensor"),
    ("ct-fp8", "block"): ("block", "group"),
}
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_HALF_RANGE = 127.5  # compressed-tensors: (q_max - q_min) / 2
DEEPSEEK_AMAX_FLOOR = 1e-4  # DeepSeek-V3 inference/kernel.py act_quant_kernel
BLOCK_MODEL = dict(  # in dims all multiples of 128; k/v out 192 ends in a partial block
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=False,
)


def make_block_model(out_dir: Path) -> Path:
    """A tiny random Qwen3 (fp32) for the 128-block formats, saved with the tests' tokenizer."""
    import transformers

    from tests import tiny_models as tiny

    torch.manual_seed(tiny.SEED)
    config = transformers.Qwen3Config(**(tiny._COMMON | BLOCK_MODEL))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tiny._perturb(model)
    model.eval().save_pretrained(out_dir)
    for name in tiny.TOKENIZER_FILES:
        shutil.copyfile(tiny._tokenizer_dir(tiny.VOCAB_SIZE) / name, Path(out_dir) / name)
    return Path(out_dir)


# --- weights ---


def weight_grid(fmt: str, variant: str, shape: tuple[int, int]) -> tuple[int, int]:
    """Rows x columns of weights that share one scale."""
    strategy = "block" if fmt == "fp8-block" else CT_STRATEGIES[fmt, variant][0]
    return {"channel": (1, shape[1]), "tensor": shape, "block": (BLOCK, BLOCK)}[strategy]


def _cell_amax(w: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """amax(|w|) of each grid cell, (ceil(out/g0), ceil(in/g1)); zero padding cannot raise it."""
    pad = ((-w.shape[1]) % grid[1], (-w.shape[0]) % grid[0])
    padded = torch.nn.functional.pad(w.abs(), (0, pad[0], 0, pad[1]))
    rows, cols = padded.shape[0] // grid[0], padded.shape[1] // grid[1]
    return padded.reshape(rows, grid[0], cols, grid[1]).amax(dim=(1, 3))


def expand(scale: torch.Tensor, grid: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """One scale per weight element."""
    scale = scale.reshape(-1, scale.shape[-1]) if scale.ndim else scale.reshape(1, 1)
    full = scale.repeat_interleave(grid[0], 0).repeat_interleave(grid[1], 1)
    return full[: shape[0], : shape[1]]


def quantize_weight(w: torch.Tensor, fmt: str, variant: str) -> tuple[dict, torch.Tensor]:
    """The stored tensors of one linear and its exactly dequantized weight (float64)."""
    grid = weight_grid(fmt, variant, tuple(w.shape))
    amax = _cell_amax(w, grid)
    if fmt == "fp8-block":
        scale = torch.where(amax > 0, 1.0 / (FP8_MAX / amax), torch.ones_like(amax))
        if variant == "ue8m0":
            scale = ceil_pow2(scale)
            scaled = w / expand(scale, grid, w.shape)
        else:
            scaled = w * expand(torch.where(amax > 0, FP8_MAX / amax, 1.0), grid, w.shape)
        codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        stored = {"weight": codes, "weight_scale_inv": scale.to(torch.float32)}
    else:
        half = INT8_HALF_RANGE if fmt == "ct-w8a8" else FP8_MAX
        scale = amax / half
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
        scaled = w / expand(scale, grid, w.shape)
        if fmt == "ct-w8a8":
            codes = torch.round(scaled.clamp(-128, 127)).to(torch.int8)
        else:
            codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if CT_STRATEGIES[fmt, variant][0] == "tensor":
            scale = scale.reshape(1)
        stored = {"weight": codes, "weight_scale": scale.to(w.dtype)}
    dequant = codes.double() * expand(scale.double(), grid, w.shape)
    return stored, dequant


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(s)) exactly, for s > 0 (frexp: s = m * 2**e with m in [0.5, 1))."""
    mantissa, exponent = torch.frexp(s)
    return torch.where(mantissa == 0.5, s, torch.ldexp(torch.ones_like(s), exponent))


# --- activations: the reference's input quantizers ---


@dataclass(frozen=True)
class InputQuant:
    """Fake quantization (quantize, then dequantize) of a linear's input.

    ``style`` "ct": compressed-tensors 0.20 ``forward_quantize`` (lifecycle/forward.py) ->
    ``compute_dynamic_scales_and_zp`` / ``calculate_qparams`` (utils/helpers.py) ->
    ``_quantize_dequantize`` (forward_helpers.py): per token (last dim) / per group of
    ``group`` / per tensor with the static ``scale``; dynamic scale = max(|min(x, 0)|, max(x, 0))
    / 127.5 (int8) or / 448 (fp8), a zero scale replaced by finfo(dtype).eps; q = round_half_even(
    clamp(x / s, -128, 127)) or fp8_e4m3(clamp(x / s, -448, 448)); result q * s.
    (compressed-tensors reduces "token" over dims >= 2, i.e. per token for transformers' 3-D
    inputs; a 2-D input would be one tensor there - the runtime kernels go per token.)

    ``style`` "deepseek": DeepSeek-V3 inference/kernel.py ``act_quant_kernel`` per token per
    group of 128: ``amax = tl.maximum(tl.max(tl.abs(x)), 1e-4); s = amax / 448.`` (ue8m0:
    ``s = tl.math.exp2(tl.math.ceil(tl.math.log2(s)))``); ``y = (x / s).to(float8_e4m3fn)``; the
    GEMM multiplies back by s. No clamp: |x / s| <= 448 up to a rounding fp8 takes back to 448.
    transformers' kernel (kernels-community finegrained-fp8 ``fp8_act_quant_inline``) differs:
    no 1e-4 floor (it divides by max(s, 1e-12)) and no ue8m0 rounding of activation scales.
    """

    style: str  # "ct" | "deepseek"
    fp8: bool
    group: int | None = None  # None: per token (or per tensor when scale is set)
    scale: torch.Tensor | None = None  # static per-tensor input scale
    pow2: bool = False  # ue8m0 activation scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "deepseek":
            return _deepseek_qdq(x, self.pow2)
        return _ct_qdq(x, self)


def _ct_qdq(x: torch.Tensor, q: InputQuant) -> torch.Tensor:
    shape = x.shape
    if q.group is not None:
        x = x.unflatten(-1, (-1, q.group))
    half, lo, hi = (FP8_MAX, -FP8_MAX, FP8_MAX) if q.fp8 else (INT8_HALF_RANGE, -128.0, 127.0)
    if q.scale is None:
        amax = torch.maximum(
            x.amin(-1, keepdim=True).clamp(max=0).abs(), x.amax(-1, keepdim=True).clamp(min=0)
        )
        scale = amax / half
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    else:
        scale = q.scale
    scaled = (x / scale).clamp(lo, hi)
    codes = scaled.to(FP8).to(x.dtype) if q.fp8 else torch.round(scaled)
    return (codes.to(scale.dtype) * scale).reshape(shape).to(x.dtype)


def _deepseek_qdq(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    groups = x.float().unflatten(-1, (-1, BLOCK))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=DEEPSEEK_AMAX_FLOOR)
    s = amax / FP8_MAX
    if pow2:
        s = ceil_pow2(s)
    y = (groups / s).to(FP8).float()
    return (y * s).flatten(-2).to(x.dtype)


def input_quantizers(out_dir: Path) -> dict[str, InputQuant]:
    """module name -> the input quantizer of every quantized linear of ``out_dir``."""
    out_dir = Path(out_dir)
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(out_dir / WEIGHTS_NAME))
    if qc["quant_method"] == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("static fp8-block activations are not written here")
        quant = InputQuant("deepseek", True, BLOCK, pow2=qc.get("scale_fmt") == "ue8m0")
        suffix = ".weight_scale_inv"
        return {k.removesuffix(suffix): quant for k in tensors if k.endswith(suffix)}
    (group,) = qc["config_groups"].values()
    args = group["input_activations"]
    fp8, kind = args["type"] == "float", (args["strategy"], bool(args["dynamic"]))
    if kind not in (("token", True), ("tensor", False), ("group", True)):
        raise ValueError(f"input activations {kind} are not written here")
    gs = args["group_size"] if args["strategy"] == "group" else None
    modules = [k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")]
    static = {m: None if args["dynamic"] else tensors[f"{m}.input_scale"] for m in modules}
    return {m: InputQuant("ct", fp8, gs, static[m]) for m in modules}


def attach_input_quantizers(model: torch.nn.Module, quantizers: dict) -> list:
    """Forward pre-hooks on the named linears; returns the hook handles."""
    modules = dict(model.named_modules())
    missing = sorted(set(quantizers) - set(modules))
    if missing:
        raise KeyError(f"the model has no module {missing[0]}")

    def hook(quant):
        return lambda module, args: (quant(args[0]), *args[1:])

    return [modules[name].register_forward_pre_hook(hook(q)) for name, q in quantizers.items()]


def reference_model(ref_dir: Path, out_dir: Path) -> torch.nn.Module:
    """transformers' fp32 eager model of ``ref_dir`` with the input fake quantization of
    ``out_dir``'s format on every quantized linear (handles in ``model.act_quant_handles``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.act_quant_handles = attach_input_quantizers(model, input_quantizers(out_dir))
    return model


# --- the writer ---


def _ct_args(fp8: bool, strategy: str, dynamic: bool, observer: str | None = None) -> dict:
    """``QuantizationArgs`` as compressed-tensors 0.20 serializes them (unset fields omitted)."""
    args = {
        "dynamic": dynamic,
        "group_size": BLOCK if strategy == "group" else None,
        "num_bits": 8,
        "strategy": strategy,
        "symmetric": True,
        "type": "float" if fp8 else "int",
    }
    if strategy == "block":
        args["block_structure"] = [BLOCK, BLOCK]
    return args | ({"observer": observer} if observer else {})


def ct_quantization_config(fmt: str, variant: str, ignore) -> dict:
    fp8, (w_strategy, a_strategy) = fmt == "ct-fp8", CT_STRATEGIES[fmt, variant]
    name = "float-quantized" if fp8 else "int-quantized"
    # the FP8 preset names its static observer; the others leave it unset
    observer = "static_minmax" if (fmt, variant) == ("ct-fp8", "static") else None
    group = {
        "format": name,
        "input_activations": _ct_args(fp8, a_strategy, variant != "static", observer),
        "output_activations": None,
        "targets": ["Linear"],
        "weights": _ct_args(fp8, w_strategy, False),
    }
    return ct_config_envelope(group, name, ignore)


def fp8_quantization_config(variant: str, skipped) -> dict:
    """The ``quantization_config`` DeepSeek-V3 / Qwen3-FP8 ship (V3.1 adds ``scale_fmt``)."""
    config = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    if variant == "ue8m0":
        config["scale_fmt"] = "ue8m0"
    return config | ({"modules_to_not_convert": list(skipped)} if skipped else {})


def calibrate_input_amax(dense_dir: Path, modules: list[str], seed: int) -> dict[str, float]:
    """amax(|input|) of each named linear of the dense model over a random calibration batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    seen: dict[str, float] = {}

    def hook(name):
        def record(module, args):
            seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))

        return record

    named = dict(model.named_modules())
    handles = [named[m].register_forward_pre_hook(hook(m)) for m in modules]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return seen


def _check(fmt: str, variant: str, module: str, shape) -> None:
    if fmt not in FORMATS or variant not in VARIANTS[fmt]:
        raise ValueError(f"unknown format/variant {fmt}/{variant}; expected one of {VARIANTS}")
    blocks = fmt == "fp8-block" or variant == "block"
    if blocks and shape[1] % BLOCK:
        raise ValueError(f"{module}: in {shape[1]} is not a multiple of {BLOCK}")
    if fmt == "fp8-block" and module == "lm_head":
        raise ValueError("transformers never converts lm_head to FP8Linear: keep it in ignore")


def write_act_quantized(
    dense_dir: Path,
    out_dir: Path,
    ref_dir: Path,
    fmt: str,
    *,
    variant: str,
    ignore: tuple[str, ...] = ("lm_head",),
    act_clip: float = 0.8,
    seed: int = 0,
) -> None:
    """Quantize every linear of the fp32 ``dense_dir`` (bar ``ignore``, compressed-tensors'
    matching) into ``out_dir`` as ``fmt``/``variant``; write the dequantized weights to
    ``ref_dir``. ``seed`` drives the static variants' calibration batch."""
    dense_dir, out_dir, ref_dir = Path(dense_dir), Path(out_dir), Path(ref_dir)
    tensors = load_file(str(dense_dir / WEIGHTS_NAME))
    out, ref, names, skipped = dict(tensors), dict(tensors), [], []
    for name in sorted(tensors):
        tensor, module = tensors[name], name.removesuffix(".weight")
        if not _is_linear(name, tensor):
            continue
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name} is {tensor.dtype}: the dense checkpoint must be fp32")
        if is_ignored(module, ignore):
            skipped.append(module)
            continue
        _check(fmt, variant, module, tensor.shape)
        names.append(module)
        stored, dequant = quantize_weight(tensor, fmt, variant)
        ref[name] = dequant.to(tensor.dtype)
        del out[name]
        out.update({f"{module}.{key}": value for key, value in stored.items()})
    if not names:
        raise ValueError(f"no linear of {dense_dir} is left to quantize (ignore={ignore})")
    if variant == "static":
        half = INT8_HALF_RANGE if fmt == "ct-w8a8" else FP8_MAX
        for module, amax in calibrate_input_amax(dense_dir, names, seed).items():
            scale = torch.tensor([act_clip * amax], dtype=torch.float32) / half
            out[f"{module}.input_scale"] = scale
    if fmt == "fp8-block":
        config = fp8_quantization_config(variant, [m for m in skipped if m != "lm_head"])
    else:
        config = ct_quantization_config(fmt, variant, ignore)
    _write_dir(dense_dir, out_dir, out, config)
    _write_dir(dense_dir, ref_dir, ref, None)
