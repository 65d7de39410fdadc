"""The weight-only integer linear method: a ``Linear`` whose weight stays quantized in memory
(``kernels.quant``'s panel layout, which snapshots store as it lies) and is dequantized inside
the GEMM. The loader hands it each tensor in the one layout of ``models.quant_formats``;
``loaded`` packs it for the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels import quant
from warmboot.kernels.act_quant import fake_quant
from warmboot.models.layers.linear import Linear, LinearMethod
from warmboot.models.quant_config import QuantScheme
from warmboot.models.registry import UnsupportedModelError


class QuantMethod(LinearMethod):
    """``scheme``'s linears: parameters ``weight`` (packed codes), ``weight_scale``,
    ``weight_zero`` (asymmetric schemes), ``weight_perm`` (act-order), ``input_scale``
    (static activation scales), ``bias``."""

    packable = False  # NOTE: a compiled step keeps it (no bf16 panels of its own)

    def __init__(self, scheme: QuantScheme):
        self.scheme = scheme
        self.bits = scheme.bits

    def group_size(self, layer: Linear) -> int:
        return self.scheme.group_size or layer.in_features

    def create_weights(self, layer: Linear, bias: bool) -> None:
        n, k, bits = layer.out_features, layer.in_features, self.bits
        group = self.group_size(layer)
        if k % group or (bits == 4 and k % 2):
            raise UnsupportedModelError(
                f"{layer.in_features} inputs are not whole groups of {group} ({self.scheme.describe()})"
            )
        codes, groups = quant.packed_shapes(n, k, bits, group)
        layer.weight = _param(codes, torch.uint8)
        layer.weight_scale = _param(groups, torch.float32)
        layer.weight_zero = None if self.scheme.symmetric else _param(groups, torch.uint8)
        layer.weight_perm = _param((k,), torch.int64) if self.scheme.act_order else None
        static = self.scheme.act is not None and self.scheme.act.static
        layer.input_scale = _param((1,), torch.float32) if static else None
        layer.bias = _param((n,), torch.float32) if bias else None

    def loaded(self, layer: Linear, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor in the one layout -> the kernel's (a snapshot's, already
        packed, as it is)."""
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
        act = self.scheme.act
        if act is not None:
            x = fake_quant(
                x, act.number, act.strategy, act.group_size, act.rule, act.ue8m0, layer.input_scale
            )
        return torch.ops.warmboot.quant_linear(
            x,
            layer.weight,
            layer.weight_scale,
            layer.weight_zero,
            layer.weight_perm,
            layer.bias,
            layer.out_features,
            self.bits if self.scheme.number == "int" else quant.FP8,
            self.group_size(layer),
        )

    def dense_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized ``(N, K)`` weight in the checkpoint's input order (tests, tools)."""
        w = quant.dequantize(
            layer.weight,
            layer.weight_scale,
            layer.weight_zero,
            self.bits if self.scheme.number == "int" else quant.FP8,
            self.group_size(layer),
            layer.out_features,
            dtype,
        )
        if layer.weight_perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, layer.weight_perm, w)


def _param(shape: tuple, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def quantize_linear(layer: Linear, scheme: QuantScheme) -> None:
    """Make ``layer`` (built, weights unset) one of ``scheme``'s linears."""
    bias = layer.bias is not None
    for leaf in ("weight", "bias", "weight_scale", "weight_zero", "weight_perm", "input_scale"):
        if hasattr(layer, leaf):
            delattr(layer, leaf)
    layer.method = QuantMethod(scheme)
    layer.method.create_weights(layer, bias)
