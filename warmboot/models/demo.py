"""The built-in demo model: a randomly initialised Llama with the SmolLM-135M shape.

Everything is written without ``transformers``: an HF-style ``config.json``,
``generation_config.json``, a streamed ``model.safetensors`` and the trained demo tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from warmboot.config import cache_root, pid_alive

if TYPE_CHECKING:  # NOTE: torch is imported where weights are written: `serve` finds the
    import torch  # model's path without it, before its engine process imports torch

DEFAULT_MODEL_NAME = "warmboot-demo-135m"
DEFAULT_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)
DEFAULT_SEED = 0
INITIALIZER_RANGE = 0.02
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_TMP_PREFIX = ".tmp-"
_ROWS_PER_CHUNK = 4096


def default_model_dir() -> Path:
    """Where the default demo model lives: ``cache_root()/models/DEFAULT_MODEL_NAME``."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(path: Path | None = None) -> Path:
    """Create the demo model at ``path`` (default ``default_model_dir()``) if absent; return it.

    The model is built in a temporary sibling directory and moved into place with
    ``os.replace``, so a half-written directory is never used. Stale temporary directories
    left by dead processes are removed.
    """
    path = Path(path) if path is not None else default_model_dir()
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(path)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{path.name}-{os.getpid()}-", dir=path.parent))
    try:
        tmp.chmod(0o755)
        write_random_llama(tmp, seed=DEFAULT_SEED, dtype="bfloat16", **DEFAULT_SHAPE)
        from warmboot.tokenizer.train import train_tokenizer

        train_tokenizer(tmp, DEFAULT_SHAPE["vocab_size"])
        _move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_random_llama(
    out_dir: str | Path,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    seed: int,
    dtype: str | torch.dtype,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
) -> None:
    """Write a random ``LlamaForCausalLM`` (config, generation config, safetensors) to ``out_dir``.

    Linear and embedding weights are normal with std ``INITIALIZER_RANGE``, norms are ones;
    tensors are generated one by one from ``seed`` and streamed to disk in ``dtype``.
    """
    import torch

    torch_dtype = _as_dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        dtype=str(torch_dtype).removeprefix("torch."),
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
    )
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    shapes = llama_weight_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    _write_safetensors(out_dir / "model.safetensors", shapes, torch_dtype, generator)


def llama_config(*, dtype: str, **shape) -> dict:
    """An HF ``LlamaConfig``-compatible ``config.json`` dict for the given shape."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_scaling": None,
        "use_cache": True,
        **shape,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def llama_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama checkpoint, in file order."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _generation_config(config: dict) -> dict:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    }


def _write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Stream tensors to a safetensors file chunk by chunk, so memory stays small."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = itemsize * _numel(shape)
        entry = {"dtype": _SAFETENSORS_DTYPES[_name(dtype)], "shape": list(shape)}
        header[name] = entry | {"data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            for chunk in _random_chunks(name, shape, dtype, gen):
                f.write(chunk.contiguous().view(torch.uint8).numpy().tobytes())


def _random_chunks(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    import torch

    if name.endswith("norm.weight"):
        yield torch.ones(shape, dtype=dtype)
        return
    rows, cols = shape
    for start in range(0, rows, _ROWS_PER_CHUNK):
        n = min(_ROWS_PER_CHUNK, rows - start)
        yield (torch.randn(n, cols, generator=gen) * INITIALIZER_RANGE).to(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or _name(dtype) not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16, float16 or float32")
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def _move_into_place(tmp: Path, path: Path) -> None:
    """``os.replace`` tmp onto path; a complete model already there (a racing process) wins."""
    if path.exists() and not _is_complete(path):
        shutil.rmtree(path)
    try:
        os.replace(tmp, path)
    except OSError:
        if not _is_complete(path):
            raise


def _remove_stale_tmp_dirs(path: Path) -> None:
    """Delete ``.tmp-<name>-<pid>-*`` siblings whose creating process is gone."""
    for tmp in path.parent.glob(f"{_TMP_PREFIX}{path.name}-*"):
        pid = tmp.name.removeprefix(f"{_TMP_PREFIX}{path.name}-").split("-", 1)[0]
        if not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)
    return True
