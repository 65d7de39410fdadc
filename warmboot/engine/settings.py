"""What the frozen configs leave open ("auto"), resolved once for this machine at start-up.
The results go into ``Settings`` and ``RuntimeFacts``; the configs are never written back."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from warmboot.config import (
    DEFAULT_MAX_MODEL_LEN,
    EAGER_ENV,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_eager,
)
from warmboot.device.threads import default_threads, usable_cpus
from warmboot.kernels.backend import AttentionBackend, KVLayout
from warmboot.kernels.torch_attention import TorchAttentionBackend
from warmboot.tokenizer import Tokenizer

log = logging.getLogger(__name__)

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
    kv_bytes_per_token: int = 0
    """KV cache bytes per token across all layers (the model's ``KVLayout``: MLA's are few)."""


@dataclass(frozen=True)
class Settings:
    """The engine's resolved choices."""

    device: torch.device
    dtype: torch.dtype
    scheduler: SchedulerConfig
    """``max_model_len`` filled in."""
    pipelined: bool
    cuda_graphs: bool
    compiled: bool
    """Model steps compiled (``device.compiled``)."""
    cpu_threads: int | None


def resolve(config: EngineConfig, model: ModelConfig) -> Settings:
    device = resolve_device(config.device)
    pipelined = resolve_pipelined(config.pipelined, device)
    eager = resolve_eager(config.enforce_eager)
    for name in ("cuda_graphs", "compile_steps"):
        if config.enforce_eager and getattr(config, name):
            raise ValueError(f"enforce_eager=True and {name}=True contradict each other")
    # NOTE: an explicit cuda_graphs / compile_steps wins over the environment's eager default
    graphs = resolve_cuda_graphs(config.cuda_graphs, device) and (config.cuda_graphs or not eager)
    compiled = resolve_compiled(config.compile_steps, device)
    return Settings(
        device=device,
        dtype=resolve_dtype(config.dtype, model, device),
        scheduler=resolve_scheduler(config.scheduler, model),
        pipelined=pipelined,
        cuda_graphs=graphs,
        compiled=compiled and (bool(config.compile_steps) or not eager),
        cpu_threads=cpu_threads(config, device),
    )


def resolve_compiled(compile_steps: bool | None, device: torch.device) -> bool:
    """Default: compiled on the CPU (1.2-1.6x eager decode, docs/benchmarks/decode.md); off on
    CUDA, where CUDA graphs already remove the step's dispatch and the compiled path has not
    been measured on a GPU yet (``bench/gpu_run.sh`` times both)."""
    return device.type == "cpu" if compile_steps is None else compile_steps


def resolve_scheduler(cfg: SchedulerConfig, model: ModelConfig) -> SchedulerConfig:
    """``max_model_len`` filled in: the model's context, at most ``DEFAULT_MAX_MODEL_LEN``,
    when unsaid; one longer than the model's context is refused."""
    limit = model.context_limit
    length = cfg.max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit)
    if length > limit:
        raise ValueError(f"max_model_len={length} exceeds the model's context ({limit} positions)")
    return replace(cfg, max_model_len=length)


def resolve_pipelined(pipelined: bool | None, device: torch.device) -> bool:
    """Default: pipelined on CUDA and on CPUs with >= 4 cores. On smaller CPUs the host thread
    would take a core from the matmuls, which costs more than the bubble it removes."""
    if pipelined is not None:
        return pipelined
    return device.type == "cuda" or (os.cpu_count() or 1) >= 4


def mode_unsaid(enforce_eager: bool | None) -> bool:
    """Neither ``enforce_eager`` nor ``$WARMBOOT_ENFORCE_EAGER`` says eager or compiled: the
    serving step is then chosen by measurement (``device.step_choice``)."""
    return enforce_eager is None and os.environ.get(EAGER_ENV, "") == ""


def resolve_cuda_graphs(cuda_graphs: bool | None, device: torch.device) -> bool:
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, not {device}")
    return device.type == "cuda" if cuda_graphs is None else cuda_graphs


def cpu_threads(config: EngineConfig, device: torch.device) -> int | None:
    """On the CPU the "device" is an executor thread with ``cpu_threads`` torch threads;
    default: the thread policy's (``device.threads``), either loop."""
    if device.type != "cpu":
        return None
    # NOTE: only the device thread takes it (``CpuStream``): the caller's own torch threads,
    # which the loading phases use, are the caller's business
    return config.cpu_threads or default_threads(len(usable_cpus()))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: on CUDA the checkpoint's half type (bf16 for fp32 checkpoints); on a CPU with
    native bf16 (AVX-512 BF16 or AMX) bf16 for a bf16 checkpoint, as vLLM does; else fp32."""
    if name == "auto":
        ckpt = _DTYPES.get(cfg.checkpoint_dtype, torch.bfloat16)
        if device.type == "cpu":
            native = ckpt == torch.bfloat16 and native_bf16()
            return torch.bfloat16 if native else torch.float32
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def native_bf16() -> bool:
    """The host CPU computes bf16 natively (read from the host's flags, also in gVisor)."""
    from warmboot.host import host_cpu_flags

    return bool(host_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def wants_pretune(setting: bool | None, device: torch.device, backend: str, publishing: bool):
    """Whether start-up tunes the prefill kernel for every shape (``pretune_attention``)."""
    if device.type != "cuda" or backend != "triton":
        return False
    return publishing if setting is None else setting


def attention_backend(
    name: str, device: torch.device, layout: Callable[[], tuple[KVLayout, int]] | None = None
) -> AttentionBackend:
    """auto: Triton on CUDA (torch for a KV layout its kernels refuse: ``layout`` gives the
    model's layout and query heads), torch elsewhere. triton on the CPU needs Triton's
    interpreter."""
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

    backend = TritonAttentionBackend()
    if name == "auto" and layout is not None:
        try:
            backend.check_layout(*layout())
        except ValueError as e:
            log.warning("%s; attention runs on the torch backend", e)
            return TorchAttentionBackend()
    return backend


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
