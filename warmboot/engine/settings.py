"""What the frozen configs leave open ("auto"), resolved once for this machine at start-up.
The results go into ``Settings`` and ``RuntimeFacts``; the configs are never written back."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from warmboot.config import EngineConfig, ModelConfig, SchedulerConfig
from warmboot.kernels.backend import AttentionBackend
from warmboot.kernels.torch_attention import TorchAttentionBackend
from warmboot.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeFacts:
    """Values discovered at start-up (never written back into the configs)."""

    device: str
    dtype: str
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str


@dataclass(frozen=True)
class Settings:
    """The engine's resolved choices."""

    device: torch.device
    dtype: torch.dtype
    scheduler: SchedulerConfig
    """``max_model_len`` filled in."""
    pipelined: bool
    cuda_graphs: bool
    cpu_threads: int | None


def resolve(config: EngineConfig, model: ModelConfig, max_model_len: int | None) -> Settings:
    device = resolve_device(config.device)
    pipelined = resolve_pipelined(config.pipelined, device)
    return Settings(
        device=device,
        dtype=resolve_dtype(config.dtype, model, device),
        scheduler=resolve_scheduler(config.scheduler, model, max_model_len),
        pipelined=pipelined,
        cuda_graphs=resolve_cuda_graphs(config.cuda_graphs, device),
        cpu_threads=cpu_threads(config, device, pipelined),
    )


def resolve_scheduler(
    cfg: SchedulerConfig, model: ModelConfig, max_model_len: int | None
) -> SchedulerConfig:
    limit = model.max_position_embeddings
    length = max_model_len or min(cfg.max_model_len, limit)
    if length > limit:
        raise ValueError(
            f"max_model_len={length} exceeds the model's max_position_embeddings={limit}"
        )
    return replace(cfg, max_model_len=length)


def resolve_pipelined(pipelined: bool | None, device: torch.device) -> bool:
    """Default: pipelined on CUDA and on CPUs with >= 4 cores. On smaller CPUs the host thread
    would take a core from the matmuls, which costs more than the bubble it removes."""
    if pipelined is not None:
        return pipelined
    return device.type == "cuda" or (os.cpu_count() or 1) >= 4


def resolve_cuda_graphs(cuda_graphs: bool | None, device: torch.device) -> bool:
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, not {device}")
    return device.type == "cuda" if cuda_graphs is None else cuda_graphs


def cpu_threads(config: EngineConfig, device: torch.device, pipelined: bool) -> int | None:
    """On the CPU the "device" is an executor thread; pipelined leaves one core to the host."""
    if device.type != "cpu":
        return None
    threads = config.cpu_threads or max(1, (os.cpu_count() or 1) - int(pipelined))
    torch.set_num_threads(threads)  # the loading phases run on this thread
    return threads


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = _DTYPES.get(cfg.checkpoint_dtype, torch.bfloat16)
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def wants_pretune(setting: bool | None, device: torch.device, backend: str, publishing: bool):
    """Whether start-up tunes the prefill kernel for every shape (``pretune_attention``)."""
    if device.type != "cuda" or backend != "triton":
        return False
    return publishing if setting is None else setting


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton on CUDA, torch elsewhere. triton on the CPU needs Triton's interpreter."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention_backend {name!r}; use auto, torch or triton")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            "attention_backend='triton' on a CPU device runs only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 before warmboot's kernels are imported (slow; for tests)"
        )
    # NOTE: imported here so the kernels are defined only when used (and after the env is set)
    from warmboot.kernels.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def eos_ids(model_dir: Path, cfg: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, plus the tokenizer's."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        ids += list(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
