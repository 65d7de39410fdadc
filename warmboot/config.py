"""Frozen configuration objects. Values discovered at run time live elsewhere (``RuntimeFacts``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


EAGER_ENV = "WARMBOOT_ENFORCE_EAGER"


def resolve_eager(enforce_eager: bool | None) -> bool:
    """``enforce_eager``, or when unsaid ``$WARMBOOT_ENFORCE_EAGER=1`` (the test suite's
    default, and a quick way to rule the compiler out)."""
    if enforce_eager is not None:
        return enforce_eager
    return os.environ.get(EAGER_ENV, "0") not in ("", "0")


def cache_root() -> Path:
    """Root of every cache warmboot keeps (demo models, snapshots, autotune results):
    ``$WARMBOOT_CACHE`` or ``~/.cache/warmboot``."""
    env = os.environ.get("WARMBOOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "warmboot"


class ModelFilesError(FileNotFoundError):
    """A file the model directory must hold is missing."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts of a checkpoint, parsed from its ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2 always, Llama with ``attention_bias``)."""
    o_bias: bool
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    sliding_windows: tuple[int | None, ...]
    """Per layer: attend to the last ``w`` positions only, or None for full attention."""
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelFilesError(f"model directory {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"warmboot supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        layers = cfg["num_hidden_layers"]
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_parse_rope(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_parse_sliding_windows(cfg, arch, layers),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            bos_token_id=cfg.get("bos_token_id"),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_theta" + "rope_scaling".
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _parse_sliding_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" or arch == "LlamaForCausalLM":
        return (window,) * layers
    # Qwen2/Qwen3: sliding only where layer_types (or use_sliding_window/max_window_layers) say so.
    if not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:
        first_full = cfg.get("max_window_layers", layers)
        types = [
            "sliding_attention" if i >= first_full else "full_attention" for i in range(layers)
        ]
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Memory budget for the KV cache; None sizes it from ``num_blocks`` or the context length."""
    num_blocks: int | None = None
    """Force an exact number of KV blocks (tests use this to force preemption)."""
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int = 2048
    """Longest prompt + output."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"
    pipelined: bool | None = None
    """Pipelined decode loop; None picks it where it pays (CUDA, CPUs with >= 4 cores)."""
    cuda_graphs: bool | None = None
    """Replay decode-only steps as CUDA graphs; None: on for CUDA devices."""
    enforce_eager: bool | None = None
    """Run every step eagerly: no compiled steps, no CUDA graphs (as vLLM's flag). None: the
    environment's ``WARMBOOT_ENFORCE_EAGER=1``, else False."""
    compile_steps: bool | None = None
    """Compile the model steps (``device.compiled``); None: on for the CPU, off on CUDA
    (CUDA graphs replay the eager step there; compiled-then-captured is not measured yet)."""
    cpu_threads: int | None = None
    """torch intra-op threads on the CPU; None: the thread policy (``engine.threads``)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    snapshot_store: str | None = None
    """Tier-A snapshot store (a directory or ``s3://bucket/prefix``); None disables snapshots.
    A snapshot matching the compatibility key is restored instead of loading the checkpoint."""
    snapshot_publish: bool = True
    """After a cold boot with a ``snapshot_store``, publish a snapshot for the next start."""
    snapshot_timeout: float = 30.0
    """Seconds a snapshot step (lookup, restore, publish) may go without progress before it
    is abandoned: a stalled store means a cold boot (or no publish), never a hang."""
    pretune_attention: bool | None = None
    """Tune the Triton prefill kernel for every sequence-length bucket at start-up (CUDA), so
    that no request waits for tuning or compiling; None: only before publishing a snapshot,
    which then carries the results and the compiled kernels."""

    def __post_init__(self) -> None:
        if not self.snapshot_timeout > 0:
            raise ValueError(f"snapshot_timeout must be > 0 seconds, got {self.snapshot_timeout}")
