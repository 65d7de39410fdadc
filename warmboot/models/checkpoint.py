"""A model directory's checkpoint: which files hold the weights, read through ``safetensors``,
and what warmboot refuses to serve (quantized checkpoints, adapters, pickles) with the reason.
Importing it imports no torch (``preflight`` runs in the server process before any engine).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig, ModelFilesError
from warmboot.models.quant_config import QuantScheme, quant_scheme

if TYPE_CHECKING:
    import torch

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def preflight(model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
    """Everything that can be checked without reading weights: the directory, its config
    (a served architecture), a served quantization, no adapters, and the weight files."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFilesError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    check_servable(model_dir, cfg, quantization)
    checkpoint_files(model_dir)
    return cfg


def check_servable(
    model_dir: Path, cfg: ModelConfig, quantization: str | None = None
) -> QuantScheme | None:
    """Refuse what cannot be served exactly, before any weight is read; the checkpoint's
    quantization (None: full precision), checked against ``quantization`` (``LLM``'s)."""
    scheme = quant_scheme(model_dir, cfg, quantization)
    adapters = [name for name in ADAPTER_FILES if (model_dir / name).exists()]
    if adapters:
        raise UnsupportedModelError(
            f"{model_dir}: LoRA adapter files {adapters} are not supported yet; merge the "
            "adapter into the base weights (peft's merge_and_unload) or remove the files"
        )
    return scheme


def checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFilesError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    pickles = [name for name in PICKLES if (model_dir / name).is_file()]
    if pickles:
        raise UnsupportedModelError(
            f"{model_dir}: {pickles[0]} is a pickle, which warmboot never loads (it can run "
            "code); convert it to safetensors (transformers: from_pretrained, then "
            "save_pretrained(..., safe_serialization=True))"
        )
    raise ModelFilesError(
        f"model directory {model_dir} has neither model.safetensors nor model.safetensors.index.json"
    )


def checkpoint_names(model_dir: Path) -> list[str]:
    """Every tensor name of the checkpoint (headers only: no tensor is read)."""
    from safetensors import safe_open

    names: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_checkpoint(
    model_dir: Path, skip: Callable[[str], bool] | None = None, integers: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, by name (memory-mapped; floating point only unless
    ``integers``: a quantized checkpoint's); those ``skip`` names are not read (the family's
    harmless buffers, e.g. a bool causal mask)."""
    import torch
    from safetensors import SafetensorError, safe_open

    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for path in checkpoint_files(model_dir):
        try:
            f = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise UnsupportedModelError(f"{path} is not a readable safetensors file: {e}") from None
        for name in f.keys():
            if skip is not None and skip(name):
                continue
            tensor = f.get_tensor(name)
            if tensor.dtype not in floats and not (integers and _quantized_dtype(tensor)):
                raise UnsupportedModelError(
                    f"{path.name}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; "
                    "a checkpoint without a served quantization_config has float tensors only"
                )
            yield name, tensor


def _quantized_dtype(tensor: torch.Tensor) -> bool:
    """Integer codes, packed words, shapes and indices; FP8 e4m3 weights."""
    import torch

    fp8 = tensor.dtype == torch.float8_e4m3fn
    return fp8 or (not tensor.is_floating_point() and not tensor.is_complex())
