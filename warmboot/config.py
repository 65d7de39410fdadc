"""Frozen configuration objects. Values discovered at run time live elsewhere (``RuntimeFacts``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from warmboot.architectures import UnsupportedModelError, resolve_architecture, text_tower
from warmboot.cache_files import read_cache_dict
from warmboot.options import check_choices, options, setting


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
DTYPES = ("auto", "float32", "float16", "bfloat16")


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


ATTENTION_FREE = ("MambaForCausalLM", "FalconMambaForCausalLM")
"""Architectures whose configs name no attention heads (Mamba 1)."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, parsed from a checkpoint's ``config.json``;
    the family's model class reads the rest from ``hf``."""

    architecture: str
    """The served architecture's name (``warmboot.architectures``)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The whole ``config.json`` (read-only)."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file() and (Path(model_dir) / "adapter_config.json").is_file():
            base = read_cache_dict(Path(model_dir) / "adapter_config.json").get(
                "base_model_name_or_path"
            )
            raise ModelFilesError(
                f"{model_dir} is a LoRA adapter (adapter_config.json; base: {base}): serve its "
                f"base model with --enable-lora --lora-modules NAME={model_dir}, or "
                "LLM(base, enable_lora=True) with a LoRARequest"
            )
        if not path.is_file():
            raise ModelFilesError(f"model directory {model_dir} has no config.json")
        try:
            cfg = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise UnsupportedModelError(f"{path} does not hold a JSON object")
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        cfg = text_tower(cfg)  # NOTE: a multimodal checkpoint: its language model's config
        arch = resolve_architecture(cfg)
        try:
            # NOTE: attention-free Mamba 2 names only its SSM heads, Mamba 1 no heads at all
            # (no KV is ever allocated)
            attention_free = "num_attention_heads" not in cfg and (
                "num_heads" in cfg or arch in ATTENTION_FREE
            )
            num_heads = cfg.get("num_heads", 1) if attention_free else cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=_num_layers(cfg),
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
                # NOTE: Kimi Linear's configs name it model_max_length (transformers' alias)
                max_position_embeddings=cfg.get("max_position_embeddings")
                or cfg.get("model_max_length", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                bos_token_id=cfg.get("bos_token_id"),
                hf=MappingProxyType(dict(cfg)),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks {e.args[0]!r} ({arch})") from None

    def get(self, key: str, default: Any = None) -> Any:
        """``config.json``'s ``key``, or ``default`` when absent or null."""
        value = self.hf.get(key)
        return default if value is None else value

    @property
    def context_limit(self) -> int:
        """The longest context the checkpoint supports: ``max_position_embeddings``, times
        the rope ``factor`` for the scalings that extend it (linear, dynamic, yarn; as vLLM)."""
        rope = self.get("rope_parameters") or self.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if kind in ("linear", "dynamic", "yarn") and rope.get("factor"):
            return int(self.max_position_embeddings * rope["factor"])
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


DEFAULT_MAX_MODEL_LEN = 2048
"""The context an engine is sized for when ``max_model_len`` is unsaid (the checkpoint's
own, where that is shorter)."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    kv_cache_memory_bytes: int | None = setting(
        None,
        "memory for the KV cache, in bytes (default: sized from --num-kv-blocks or the "
        "context length)",
    )
    num_blocks: int | None = setting(
        None,
        "an exact number of KV blocks (as vLLM's --num-gpu-blocks-override; tests force "
        "preemption with it)",
        name="num_kv_blocks",
        aliases=("--num-gpu-blocks-override",),
    )
    enable_prefix_caching: bool = setting(True, "share the KV of common prompt prefixes")
    state_checkpoints: int | None = setting(
        None,
        "models with state layers: request states kept at block boundaries for the prefix "
        "cache (default: two per seat within a quarter of the default KV budget; 0: none, "
        "so such a model computes every prompt in full)",
    )

    def __post_init__(self) -> None:
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints must be >= 0, got {self.state_checkpoints}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = setting(64, "most requests running at once (the batch)")
    max_num_batched_tokens: int = setting(
        2048, "token budget of one step (prefill chunks + decodes)"
    )
    max_model_len: int | None = setting(
        None,
        f"longest prompt + output (default: the model's context, at most {DEFAULT_MAX_MODEL_LEN})",
    )
    long_prefill_token_threshold: int | None = setting(
        None,
        "most prompt tokens one request computes in a step, so a long prompt is spread over "
        "steps and a request arriving meanwhile starts in the next one (default: a quarter "
        "of --max-num-batched-tokens, at least 512; 0: no cap)",
    )
    prompt_logprob_token_weight: float = setting(
        1.4,
        "what a prompt token whose logprobs are wanted costs in step budget, next to a plain "
        "prefill token",
    )
    """It adds an LM head over the vocabulary, a float32 log-softmax and a top-k (1.30-1.40
    measured on the demo model's 512-token prefill, top 1 and 20, on 1 and 2 CPU threads,
    eager and compiled). With ``max_step_ms``, the weight until the step-cost fit has learnt
    it from the steps run (``core.step_cost``)."""
    max_step_ms: float | None = setting(
        None,
        "longest an engine step should run, in ms: its token budget follows the measured "
        "step cost, so a request arriving mid-step waits about this long at most (none or "
        "0: no cap, throughput first)",
    )
    """``core.step_cost``; a running stream's inter-token gap stays near it too. The server's
    default is ``cli.DEFAULT_MAX_STEP_MS``; offline, none."""
    max_loras: int = setting(
        1, "adapters the running requests may use at once (device slots)", group="LoRA"
    )
    reserved_seats: int | None = setting(
        None,
        "seats only a client's or a call's first sequence may take, so a newcomer finds one "
        "(default: --max-num-seqs / 16, at least 1)",
    )
    """A client's later calls never fill those, so a new client finds a seat, and a call's
    later prompts and completions none of them, so a new call finds one: the last half of
    them (rounded up) only a client's first may take. Fewer than ``max_num_seqs``."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_prefill_token_threshold", "reserved_seats", "max_step_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.prompt_logprob_token_weight >= 1:
            raise ValueError(
                f"prompt_logprob_token_weight must be >= 1, got {self.prompt_logprob_token_weight}"
            )

    @property
    def prefill_chunk(self) -> int:
        """The resolved ``long_prefill_token_threshold``: tokens per request per step."""
        cap = self.long_prefill_token_threshold
        if cap is None:
            cap = max(512, self.max_num_batched_tokens // 4)
        return min(cap or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @property
    def seat_ranks(self) -> tuple[int, int]:
        """(seats any sequence may hold, seats a client's or a call's first may hold): the
        reserve (``reserved_seats``) past the first, its last half (rounded up: a reserve of
        one seat is the clients') past the second."""
        reserve = self.reserved_seats
        if reserve is None:
            reserve = max(1, self.max_num_seqs // 16)
        reserve = min(reserve, self.max_num_seqs - 1)
        return self.max_num_seqs - reserve, self.max_num_seqs - (reserve + 1) // 2


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = setting(False, "serve LoRA adapters over the base model (vLLM's flag)")
    max_lora_rank: int = setting(16, "the largest adapter rank served")
    max_cpu_loras: int | None = setting(
        None, "adapters kept loaded in host memory (default: --max-loras)"
    )

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_cpu_loras"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


SNAPSHOTS = "snapshots"
"""The ``--help`` group of the snapshot settings."""


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; ``LLM``'s keyword arguments and every command line's engine
    options are derived from them (``warmboot.options``)."""

    model: str
    dtype: str = setting("auto", "weights' and activations' type", choices=DTYPES)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N", metavar="DEVICE")
    seed: int = setting(0, "seed of the samplers of requests that give none")
    attention_backend: str = setting(
        "auto",
        "attention kernels (auto: Triton on CUDA, torch elsewhere)",
        choices=("auto", "torch", "triton"),
    )
    quantization: str | None = setting(
        None,
        "auto (the checkpoint's), a method it must match (gptq, awq, compressed-tensors, "
        "fp8, mxfp4), or fp8 / int8 to quantize a full-precision checkpoint at load",
        short="-q",
    )
    """vLLM's ``quantization``: None or ``auto`` serves the checkpoint's own
    (``quantization_config``); a method name must match it (``models.quant_config``)."""
    pipelined: bool | None = setting(
        None,
        "the pipelined decode loop (auto: on CUDA and on CPUs with >= 4 cores; off: the sync loop)",
        negative=("--sync",),
    )
    cuda_graphs: bool | None = setting(
        None, "replay decode-only steps as CUDA graphs (auto: on CUDA)"
    )
    enforce_eager: bool | None = setting(
        None,
        "run the model steps eagerly, op by op: no compiled steps, no CUDA graphs (auto: "
        "$WARMBOOT_ENFORCE_EAGER=1 says on; otherwise the steps are compiled on the CPU, a "
        "compile of seconds to a minute in the background, then 1.2-1.6x faster decode, and "
        "captured as CUDA graphs on CUDA)",
    )
    compile_steps: bool | None = setting(
        None, "compile the model steps with torch.compile (auto: on the CPU, off on CUDA)"
    )
    cpu_threads: int | None = setting(
        None,
        "torch compute threads on the CPU (default: the thread policy, all cores but one for "
        "the host loop, pinned where the OS allows)",
    )
    cache: CacheConfig = setting(factory=CacheConfig, group="KV cache")
    scheduler: SchedulerConfig = setting(factory=SchedulerConfig, group="scheduler")
    lora: LoRAConfig = setting(factory=LoRAConfig, group="LoRA")
    snapshot_store: str | None = setting(
        None,
        "tier-A snapshot store (a directory or s3://bucket/prefix): start the way measured "
        "quicker here (restore, or boot cold; WARMBOOT_START_BY_COST=0: restore), publish if "
        "none matches",
        group=SNAPSHOTS,
    )
    snapshot_publish: bool = setting(
        True, "with a snapshot store: publish a snapshot after a cold boot", group=SNAPSHOTS
    )
    snapshot_timeout: float = setting(
        30.0,
        "seconds a snapshot lookup, restore or publish may go without progress before it is "
        "abandoned (then: a cold boot, or no publish)",
        group=SNAPSHOTS,
    )
    pretune_attention: bool | None = setting(
        None,
        "tune the Triton prefill kernel for every sequence-length bucket at start-up (CUDA), "
        "so no request waits for tuning (auto: only before publishing a snapshot, which then "
        "carries the results)",
        group=SNAPSHOTS,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.snapshot_timeout > 0:
            raise ValueError(f"snapshot_timeout must be > 0 seconds, got {self.snapshot_timeout}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        slots, kept = self.scheduler.max_loras, self.lora.max_cpu_loras
        if kept is not None and kept < slots:
            raise ValueError(f"max_cpu_loras ({kept}) must be >= max_loras ({slots})")


ENGINE_OPTIONS = options(EngineConfig, group="engine")
"""The engine's settings: ``LLM``'s keyword arguments, every command line's engine options."""
ENGINE_DEFAULTS = {o.name: o.default for o in ENGINE_OPTIONS}


def _num_layers(cfg: dict[str, Any]) -> int:
    """``num_hidden_layers``, or the length of the block list it is computed from (Nemotron-H
    saved by transformers 5: ``layers_block_type``), or LongCat-Flash's ``num_layers`` times
    its two attention sublayers (the engine's layers, one KV cache each: transformers' count),
    or HRM-Text's attention calls (``hrm_calls``)."""
    if cfg.get("model_type") == "longcat_flash" and cfg.get("num_hidden_layers") is None:
        return 2 * cfg["num_layers"]
    if cfg.get("model_type") == "hrm_text":
        return hrm_calls(cfg)[0]
    if "num_hidden_layers" in cfg or "layers_block_type" not in cfg:
        return cfg["num_hidden_layers"]
    return len(cfg["layers_block_type"])


def hrm_calls(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """HRM-Text's (attention calls, layers a stack, H_cycles, L_cycles): each H cycle runs
    the L stack ``L_cycles`` times, then the H stack once. ``num_layers_per_stack`` where
    saved (transformers then writes the call count as ``num_hidden_layers``), else
    ``num_hidden_layers`` is the stack's (transformers' reading of an older config)."""
    high = 2 if cfg.get("H_cycles") is None else cfg["H_cycles"]  # NOTE: transformers' defaults
    low = 3 if cfg.get("L_cycles") is None else cfg["L_cycles"]
    per_stack = cfg.get("num_layers_per_stack")
    per_stack = cfg["num_hidden_layers"] if per_stack is None else per_stack
    return per_stack * high * (low + 1), per_stack, high, low
