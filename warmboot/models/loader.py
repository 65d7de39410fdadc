"""Weight loading: the model is built on the meta device and its parameters are assigned
straight from memory-mapped safetensors files (zero-copy when dtype and device match).

Load-time transforms: q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj`` (one copy of
those weights), and a dtype conversion when the checkpoint's dtype differs from the engine's.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from warmboot.config import ModelConfig, ModelFilesError
from warmboot.models.decoder import DecoderModel
from warmboot.models.rope import cos_sin_table

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}


class SafetensorsFile:
    """A read-only view of one .safetensors file; tensors share the file's pages."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._map) < 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", self._map[:8])
        if 8 + header_len > len(self._map):
            raise ValueError(f"{path}: header length {header_len} exceeds the file size")
        header = json.loads(self._map[8 : 8 + header_len])
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or self._data_start + end > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} has inconsistent offsets")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self._map, dtype=dtype, count=numel, offset=self._data_start + begin
        )
        return flat.view(shape)


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
    raise ModelFilesError(
        f"model directory {model_dir} has neither model.safetensors nor model.safetensors.index.json"
    )


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        f = SafetensorsFile(path)
        for name in f.keys():
            yield name, f.tensor(name)


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> DecoderModel:
    """Build on meta, then assign every parameter from the checkpoint (after transforms)."""
    model_dir = Path(model_dir)
    raw = dict(iter_checkpoint(model_dir))
    weights = (
        (name, t.to(device=device, dtype=dtype)) for name, t in _transformed_weights(raw, cfg)
    )
    return assemble_model(cfg, weights, dtype, device, source=str(model_dir))


def assemble_model(
    cfg: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    source: str = "weights",
) -> DecoderModel:
    """Build on meta and assign already-transformed weights (our names, final dtype/device);
    a snapshot restore enters here with the tensors of ``named_parameters()``."""
    with torch.device("meta"):
        model = DecoderModel(cfg)
    for name, tensor in weights:
        _assign(model, name, tensor)
    unset = [n for n, p in model.named_parameters() if p.is_meta]
    if unset:
        raise ValueError(f"{source}: missing weights for {unset[:5]}")
    max_pos = max(cfg.max_position_embeddings, 1)
    model.rope_cos, model.rope_sin = cos_sin_table(cfg.rope, cfg.head_dim, max_pos, dtype, device)
    return model.eval()


def _transformed_weights(
    raw: dict[str, torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map HF names to ours, fusing q/k/v and gate/up."""

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return raw[name]

    yield "embed_tokens.weight", take("model.embed_tokens.weight")
    yield "norm", take("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", take("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        yield dst + "qkv_proj.weight", torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            yield dst + "qkv_proj.bias", torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        yield dst + "o_proj.weight", take(attn + "o_proj.weight")
        if cfg.o_bias:
            yield dst + "o_proj.bias", take(attn + "o_proj.bias")
        if cfg.qk_norm:
            yield dst + "q_norm", take(attn + "q_norm.weight")
            yield dst + "k_norm", take(attn + "k_norm.weight")
        mlp = src + "mlp."
        yield (
            dst + "gate_up_proj.weight",
            torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
        )
        yield dst + "down_proj.weight", take(mlp + "down_proj.weight")
        yield dst + "input_layernorm", take(src + "input_layernorm.weight")
        yield dst + "post_attention_layernorm", take(src + "post_attention_layernorm.weight")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = model.get_submodule(".".join(path)) if path else model
    current = getattr(module, leaf)
    if tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(current.shape)}"
        )
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
