"""Loading a quantized checkpoint: which linears are quantized (the checkpoint says: those with
the format's tensors; an ``ignore`` list's modules have dense weights), those made
``QuantMethod`` linears before any weight is read, and each one's tensors turned into the one
layout (``quant_formats``) as they stream past the loader.

A full-precision checkpoint quantized as it loads (``LLM(quantization="fp8" | "int8")``):
every linear of the decoder layers and every expert, not the LM head, the embeddings or a
router (as vLLM's online FP8 and llm-compressor's recipes leave them), each weight quantized
as it arrives (``QuantMethod.loaded``, ``kernels.quant.quantize_rows``): a dense copy of a
layer never outlives its load, and a snapshot keeps the quantized image under a key of its
own (``quantization`` is one of its fields).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import CausalLM
from warmboot.models.layers.linear import DENSE, Linear
from warmboot.models.layers.moe import DENSE_EXPERTS, FusedExperts
from warmboot.models.layers.quant_linear import (
    QuantExperts,
    QuantMethod,
    quantize_experts,
    quantize_linear,
)
from warmboot.models.quant_config import QuantScheme
from warmboot.models.quant_formats import MARKER, canonical, joined_name, leaves, split_name

QUANT_LEAVES = ("weight_scale", "weight_zero", "weight_perm", "input_scale")
"""Our quantized parameters beside ``weight`` (a snapshot's names tell its quantized linears)."""
EXPERT_LEAVES = tuple(
    f"{name}{leaf}"
    for name in ("gate_up_proj", "down_proj")
    for leaf in ("_scale", "_zero", "_perm", "_input_scale")
)
"""Likewise for quantized experts (``QuantExperts``)."""


def quantized_prefixes(names: Iterable[str], scheme: QuantScheme) -> dict[str, set[str]]:
    """Checkpoint module name -> the format's leaves it has, for every quantized linear."""
    split = [split_name(scheme, name) for name in names]
    found = {prefix: set() for prefix, leaf in split if leaf == MARKER[scheme.layout]}
    ours = leaves(scheme)
    for prefix, leaf in split:
        if prefix in found and leaf in ours:
            found[prefix].add(leaf)
    return found


def apply_scheme(model: CausalLM, scheme: QuantScheme, prefixes: Iterable[str]) -> set[str]:
    """Make the linears behind checkpoint ``prefixes`` quantized; returns our module names."""
    modules: set[str] = set()
    for prefix in prefixes:
        mapped = model.map_name(joined_name(scheme, prefix, "weight"))
        if mapped is None:
            continue
        modules.add(mapped[0].rpartition(".")[0])
    quantize_modules(model, scheme, modules)
    return modules


def online_modules(model: nn.Module) -> set[str]:
    """The modules quantized at load: the dense linears and experts of the layers."""
    found = set()
    for name, module in model.named_modules():
        if name == "lm_head":
            continue
        if type(module) is Linear and module.method is DENSE:
            found.add(name)
        elif isinstance(module, FusedExperts) and module.method is DENSE_EXPERTS:
            found.add(name)
    return found


def quantize_modules(model: nn.Module, scheme: QuantScheme, modules: Iterable[str]) -> None:
    with torch.device("meta"):
        for name in sorted(modules):
            module = model.get_submodule(name)
            if isinstance(module, FusedExperts):
                if not isinstance(module.method, QuantExperts):
                    quantize_experts(module, scheme)
                continue
            if not isinstance(module, Linear):
                raise UnsupportedModelError(
                    f"{name} is quantized in the checkpoint, but it is a "
                    f"{type(module).__name__}: only linear layers and experts are served "
                    "quantized"
                )
            if not isinstance(module.method, QuantMethod):
                quantize_linear(module, scheme)


def snapshot_modules(names: Iterable[str]) -> set[str]:
    """Our quantized modules, told by a snapshot's parameter names."""
    leaves = QUANT_LEAVES + EXPERT_LEAVES
    return {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in leaves}


def canonical_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme,
    prefixes: dict[str, set[str]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear's leaves gathered and replaced by
    the one layout's (held back until the linear's last leaf has come)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, leaf = split_name(scheme, name)
        wanted = prefixes.get(prefix)
        if wanted is None or leaf not in wanted:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        if set(got) == wanted:
            del pending[prefix]
            for out_leaf, out in canonical(scheme, prefix, got).items():
                yield joined_name(scheme, prefix, out_leaf), out
    if pending:
        raise UnsupportedModelError(f"incomplete quantized linears: {sorted(pending)[:4]}")


QUANT_DTYPES = {
    "weight": (torch.uint8,),
    "weight_zero": (torch.uint8,),
    "weight_perm": (torch.int64,),
    "weight_scale": (torch.float16, torch.bfloat16, torch.float32),
    "input_scale": (torch.float32,),
}


def quant_dtype_ok(name: str, tensor: torch.Tensor, modules: set[str]) -> bool | None:
    """Whether a quantized linear's (or experts') tensor has a dtype it is held in; None:
    not one."""
    module, _, leaf = name.rpartition(".")
    for stacked in ("gate_up_proj", "down_proj"):  # NOTE: experts: the linear's leaf names
        if leaf.startswith(stacked):
            rest = leaf.removeprefix(stacked)
            leaf = "input_scale" if rest == "_input_scale" else "weight" + rest
    if module not in modules or leaf not in QUANT_DTYPES:
        return None
    return tensor.dtype in QUANT_DTYPES[leaf]


def is_quant_leaf(name: str) -> bool:
    """A quantized linear's or experts' tensor beside the codes (kept in its own dtype)."""
    return name.rpartition(".")[2] in QUANT_LEAVES + EXPERT_LEAVES
