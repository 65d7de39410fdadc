"""Weight loading: the family's model is built on the meta device and its parameters are
assigned from the checkpoint (memory-mapped by ``safetensors``: zero-copy when the dtype
matches), after the family's name map: stacked projections (q/k/v, gate/up) concatenated,
per-expert tensors stacked, layouts transformed. Every checkpoint tensor is consumed or, unless
the family lists it as harmless, refused by name; every parameter must be set.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import CausalLM
from warmboot.models.checkpoint import check_servable, checkpoint_names, iter_checkpoint
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts
from warmboot.models.quant_config import quant_scheme
from warmboot.models.quant_loader import (
    apply_scheme,
    canonical_stream,
    is_quant_leaf,
    online_modules,
    quantize_modules,
    quantized_prefixes,
    snapshot_modules,
)
from warmboot.models.registry import model_class


def build_model(cfg: ModelConfig) -> CausalLM:
    """The family's model on the meta device (no memory)."""
    with torch.device("meta"):
        return model_class(cfg.architecture)(cfg)


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    progress: Callable[[int], None] | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """The model with the checkpoint's weights; rope tables for ``max_positions``.
    ``progress(n)`` hears the bytes of each checkpoint tensor read (a start-up bar);
    ``quantization``: ``LLM(quantization=)``, checked against the checkpoint's."""
    model_dir = Path(model_dir)
    scheme = check_servable(model_dir, cfg, quantization)
    model = build_model(cfg)
    skip = lambda name: model.map_name(name) is None  # noqa: E731
    stored = scheme is not None and not scheme.online
    integers = stored or getattr(model, "integer_tensors", False)  # NOTE: a hash table
    tensors = iter_checkpoint(model_dir, skip=skip, integers=integers)
    if scheme is not None and scheme.online:
        quantize_modules(model, scheme, online_modules(model))
    elif stored:
        prefixes = quantized_prefixes(checkpoint_names(model_dir), scheme)
        if not prefixes:
            raise UnsupportedModelError(
                f"{model_dir}: the config says {scheme.describe()}, but no linear in the "
                "checkpoint has that format's tensors"
            )
        apply_scheme(model, scheme, prefixes)
        tensors = canonical_stream(tensors, scheme, prefixes)
    if progress is not None:
        tensors = _counted(tensors, progress)
    named = checkpoint_weights(model, tensors, str(model_dir))
    weights = ((name, _cast(name, t, dtype, device)) for name, t in named)
    return _assign_all(model, weights, dtype, device, max_positions, str(model_dir))


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """To the engine's dtype, but integer tensors and quantization scales as they are."""
    if not t.is_floating_point() or is_quant_leaf(name):
        return t.to(device=device)
    return t.to(device=device, dtype=param_dtype(name, dtype))


def _counted(tensors: Iterable[tuple[str, torch.Tensor]], progress: Callable[[int], None]):
    for name, tensor in tensors:
        progress(tensor.nbytes)
        yield name, tensor


FLOAT32_PARAMS = re.compile(r"(^|\.)(e_score_correction_bias|indexer\.weights_proj\.weight)$")
"""Parameters kept in float32 whatever the engine's dtype (as transformers keeps them): the
router's score-correction bias, which separates experts by differences below bf16's step,
and the sparse-attention indexer's head weights."""


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` is held in, in an engine of ``dtype``."""
    return torch.float32 if FLOAT32_PARAMS.search(name) else dtype


def assemble_model(
    cfg: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    source: str = "weights",
    quantization: str | None = None,
) -> CausalLM:
    """Build on meta and assign weights already under our names, dtype and device (a
    snapshot restore enters here with the tensors of ``named_parameters()``; the names tell
    the quantized linears, the config (or ``quantization``, at load) their scheme)."""
    model = build_model(cfg)
    weights = dict(weights)
    modules = snapshot_modules(weights)
    if modules:
        scheme = quant_scheme(Path(source), cfg, quantization)
        if scheme is None:
            raise UnsupportedModelError(f"{source}: quantized weights, but no quantization_config")
        quantize_modules(model, scheme, modules)
    return _assign_all(model, weights.items(), dtype, device, max_positions, source)


def _assign_all(model, weights, dtype, device, max_positions, source) -> CausalLM:
    for name, tensor in weights:
        _assign(model, name, tensor)
    model.tie_weights()
    unset = [n for n, p in model.named_parameters() if p.is_meta]
    if unset:
        raise UnsupportedModelError(f"{source}: missing weights for {unset[:5]}")
    for rope in model.rotary_embeddings():
        rope.build(max(max_positions, 1), dtype, device)
    return model.eval()


def checkpoint_weights(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint (name, tensor) -> ours: renamed, stacked shards concatenated, transformed."""
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    shards: dict[str, list[torch.Tensor | None]] = {}
    unused: list[str] = []
    for hf_name, tensor in tensors:
        mapped = model.map_name(hf_name)
        if mapped is None:
            continue
        name, shard = mapped
        if name not in params:
            if not (tied and name == "lm_head.weight"):  # NOTE: a tied head saved anyway
                unused.append(hf_name)
            continue
        if shard is None:
            yield name, model.transform(name, tensor)
            continue
        owner, leaf = _owner(model, name), name.rpartition(".")[2]
        parts = shards.setdefault(name, [None] * owner.shard_count(leaf))
        parts[shard] = tensor
        if all(p is not None for p in parts):
            yield name, model.transform(name, owner.join_shards(leaf, parts))
            del shards[name]
    if unused:
        raise UnsupportedModelError(
            f"{source}: checkpoint tensors that {type(model).__name__} does not read: "
            f"{_names(unused)} (a setting it does not know would change the outputs)"
        )
    if shards:
        raise UnsupportedModelError(f"{source}: incomplete stacked weights {_names(list(shards))}")


def _owner(model: nn.Module, name: str) -> Linear | FusedExperts:
    return model.get_submodule(name.rpartition(".")[0])


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return ", ".join(names[:8]) + more


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = model.get_submodule(".".join(path)) if path else model
    current = getattr(module, leaf, None)
    if not isinstance(current, nn.Parameter):
        raise UnsupportedModelError(f"weight {name} has no parameter in {type(model).__name__}")
    if isinstance(module, (Linear, FusedExperts)):  # NOTE: its method's layout (quantized)
        tensor = module.method.loaded(module, leaf, tensor)
    if tuple(current.shape) != tuple(tensor.shape):
        raise UnsupportedModelError(
            f"weight {name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(current.shape)}"
        )
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
