"""The weight-only integer linear method: a ``Linear`` whose weight stays quantized in memory
(``kernels.quant``'s panel layout, which snapshots store as it lies) and is dequantized inside
the GEMM. The loader hands it each tensor in the one layout of ``models.quant_formats``;
``loaded`` packs it for the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.kernels import quant
from warmboot.kernels.act_quant import fake_quant, quantize_int8
from warmboot.kernels.experts import grouped_experts
from warmboot.models.layers.linear import Linear, LinearMethod
from warmboot.models.layers.moe import ExpertsMethod, FusedExperts
from warmboot.models.quant_config import QuantScheme
from warmboot.models.quant_formats import partial_groups


class QuantMethod(LinearMethod):
    """``scheme``'s linears: parameters ``weight`` (packed codes), ``weight_scale``,
    ``weight_zero`` (asymmetric schemes), ``weight_perm`` (act-order), ``input_scale``
    (static activation scales), ``bias``."""

    packable = False  # NOTE: a compiled step keeps it (no bf16 panels of its own)

    def __init__(self, scheme: QuantScheme):
        self.scheme = scheme
        self.bits = scheme.bits
        self.int8_gemm = _int8_gemm(scheme)

    def group_size(self, layer: Linear) -> int:
        return self.scheme.group_size or layer.in_features

    @property
    def code_bits(self) -> int:
        return code_bits(self.scheme)

    def create_weights(self, layer: Linear, bias: bool) -> None:
        shapes = _linear_shapes(self.scheme, layer.out_features, layer.in_features)
        for leaf, (shape, dtype) in shapes.items():
            setattr(layer, _LINEAR_LEAVES[leaf], None if shape is None else _param(shape, dtype))
        layer.bias = _param((layer.out_features,), torch.float32) if bias else None

    def quantize_input(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
        """``x`` as the format's runtime quantizes it before the GEMM (as it is: A16)."""
        act = self.scheme.act
        if act is None:
            return x
        return fake_quant(
            x, act.number, act.strategy, act.group_size, act.rule, act.ue8m0, input_scale
        )

    def loaded(self, layer: Linear, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor in the one layout -> the kernel's (a snapshot's, already
        packed, as it is; a full-precision weight quantized here, its scale set beside it)."""
        if leaf == "weight" and tensor.is_floating_point():
            tensor, scale = quant.quantize_rows(tensor, self.scheme.number)
            layer.weight_scale = _held(quant.pack_groups(scale))
        if leaf == "weight" and tensor.dim() == 2:
            return quant.pack_codes(tensor, self.bits)
        if leaf in ("weight_scale", "weight_zero") and tensor.dim() == 2:
            return quant.pack_groups(tensor)
        return tensor

    def join_shards(self, layer: Linear, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if leaf not in ("weight_perm", "input_scale"):
            return torch.cat(parts)
        if any(not torch.equal(p, parts[0]) for p in parts[1:]):
            what = "input orders (g_idx)" if leaf == "weight_perm" else "input scales"
            raise UnsupportedModelError(f"{layer.shards} stacked projections have different {what}")
        return parts[0]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.int8_gemm and layer.weight_perm is None and quant.runs_native_i8(x):
            return self.apply_int8(layer, x)
        x = self.quantize_input(x, layer.input_scale)
        w = (layer.weight, layer.weight_scale, layer.weight_zero)
        shape = (layer.out_features, self.code_bits, self.group_size(layer))
        if layer.weight_perm is None and quant.runs_native(x):  # NOTE: without this op's Python
            x = quant.padded_input(x, layer.weight, self.code_bits)
            return torch.ops.warmboot_cpu.quant_linear(x, *w, layer.bias, *shape)
        return torch.ops.warmboot.quant_linear(x, *w, layer.weight_perm, layer.bias, *shape)

    def apply_int8(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """W8A8 int8 in integers: the input's int8 codes and scales (``quantize_input``'s,
        unrounded) against the weight's codes, the products summed exactly."""
        xq, xs = quantize_int8(x, self.scheme.act.strategy, layer.input_scale)
        args = (layer.weight, layer.weight_scale, layer.bias, layer.out_features, x.dtype)
        return torch.ops.warmboot_cpu.quant_linear_i8(xq, xs, *args)


def _int8_gemm(scheme: QuantScheme) -> bool:
    """int8 inputs (per token or static per tensor) against 8-bit symmetric integer weights
    with a scale per channel: an integer GEMM computes them."""
    act = scheme.act
    int8_act = act is not None and act.number == "int8" and act.strategy in ("token", "tensor")
    per_channel = scheme.group_size is None and scheme.block_rows is None
    return (
        int8_act and per_channel and scheme.symmetric and (scheme.number, scheme.bits) == ("int", 8)
    )


_LINEAR_LEAVES = {
    "": "weight",
    "_scale": "weight_scale",
    "_zero": "weight_zero",
    "_perm": "weight_perm",
    "_input_scale": "input_scale",
}


def _param(shape: tuple, dtype: torch.dtype) -> nn.Parameter:
    return _held(torch.empty(shape, dtype=dtype))


def _held(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def quantize_linear(layer: Linear, scheme: QuantScheme) -> None:
    """Make ``layer`` (built, weights unset) one of ``scheme``'s linears."""
    bias = layer.bias is not None
    for leaf in ("weight", "bias", "weight_scale", "weight_zero", "weight_perm", "input_scale"):
        if hasattr(layer, leaf):
            delattr(layer, leaf)
    layer.method = QuantMethod(scheme)
    layer.method.create_weights(layer, bias)


class QuantExperts(ExpertsMethod):
    """``scheme``'s experts: each of ``gate_up_proj`` and ``down_proj`` one expert per row of
    its stacked packed codes, with ``_scale``, ``_zero``, ``_perm`` and ``_input_scale``
    beside it as ``QuantMethod``'s linears have them."""

    packable = False

    def __init__(self, scheme: QuantScheme):
        self.linear = QuantMethod(scheme)
        self.scheme = scheme

    def create_weights(self, layer: FusedExperts, bias: bool) -> None:
        e, h, i = layer.num_experts, layer.hidden, layer.intermediate
        for name, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            shapes = _linear_shapes(self.scheme, n, k)
            for leaf, (shape, dtype) in shapes.items():
                setattr(layer, name + leaf, None if shape is None else _param((e, *shape), dtype))
        layer.gate_up_proj_bias = _param((e, 2 * i), torch.float32) if bias else None
        layer.down_proj_bias = _param((e, h), torch.float32) if bias else None

    def loaded(self, layer: FusedExperts, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        if leaf in ("gate_up_proj", "down_proj") and tensor.is_floating_point():
            rows = [quant.quantize_rows(w, self.scheme.number) for w in tensor]  # NOTE: at load
            setattr(
                layer, leaf + "_scale", _held(torch.stack([quant.pack_groups(s) for _, s in rows]))
            )
            tensor = torch.stack([codes for codes, _ in rows])
        base = leaf.removeprefix("gate_up_proj").removeprefix("down_proj")
        if base in ("", "_scale", "_zero") and tensor.dim() == 3:
            as_linear = {"": "weight", "_scale": "weight_scale", "_zero": "weight_zero"}[base]
            return torch.stack([self.linear.loaded(None, as_linear, t) for t in tensor])
        return tensor

    def join_pair(self, leaf: str, pair: list[torch.Tensor]) -> torch.Tensor:
        if not leaf.endswith(("_perm", "_input_scale")):
            return torch.cat(pair)
        if not torch.equal(pair[0], pair[1]):
            raise UnsupportedModelError(f"an expert's gate and up projections differ in {leaf}")
        return pair[0]

    def apply(self, layer: FusedExperts, x, weights, ids) -> torch.Tensor:
        i2, h = 2 * layer.intermediate, layer.hidden

        def gemm(name: str, n: int, k: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
            t = [getattr(layer, name + leaf) for leaf in ("", "_scale", "_zero", "_perm")]
            scale, bias = getattr(layer, name + "_input_scale"), getattr(layer, name + "_bias")
            group = self.scheme.group_size or k
            at = lambda v, e: None if v is None else v[e]  # noqa: E731

            def run(e: int, rows: torch.Tensor) -> torch.Tensor:
                rows = self.linear.quantize_input(rows, at(scale, e))
                codes, s, z, perm = (at(v, e) for v in t)
                args = (rows, codes, s, z, perm, at(bias, e), n, self.linear.code_bits, group)
                return torch.ops.warmboot.quant_linear(*args)

            return run

        up, down = gemm("gate_up_proj", i2, h), gemm("down_proj", h, layer.intermediate)
        return grouped_experts(x, weights, ids, layer.num_experts, up, down, layer.act_and_mul)


def code_bits(scheme: QuantScheme) -> int:
    """``bits`` as the kernels take it (``kernels.quant.FP8`` / ``FP4`` for float codes)."""
    return {"int": scheme.bits, "fp8": quant.FP8, "fp4": quant.FP4}[scheme.number]


def _linear_shapes(scheme: QuantScheme, n: int, k: int) -> dict[str, tuple]:
    """Each quantized leaf's (shape or None, dtype) for an ``(n, k)`` weight."""
    bits = code_bits(scheme)
    group = scheme.group_size or k
    if (k % group and not partial_groups(scheme)) or (abs(bits) == 4 and k % 2):
        raise UnsupportedModelError(
            f"{k} inputs are not whole groups of {group} ({scheme.describe()})"
        )
    codes, groups = quant.packed_shapes(n, -(-k // group) * group, bits, group)
    static = scheme.act is not None and scheme.act.static
    return {
        "": (codes, torch.uint8),
        "_scale": (groups, torch.float32),
        "_zero": (None if scheme.symmetric else groups, torch.uint8),
        "_perm": ((k,) if scheme.act_order else None, torch.int64),
        "_input_scale": ((1,) if static else None, torch.float32),
    }


def quantize_experts(layer: FusedExperts, scheme: QuantScheme) -> None:
    """Make ``layer`` (built, weights unset) ``scheme``'s experts."""
    bias = layer.gate_up_proj_bias is not None
    for name in ("gate_up_proj", "down_proj"):
        for leaf in ("", "_scale", "_zero", "_perm", "_input_scale", "_bias"):
            if hasattr(layer, name + leaf):
                delattr(layer, name + leaf)
    layer.method = QuantExperts(scheme)
    layer.method.create_weights(layer, bias)
