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


def read_cache_dict(path: Path) -> dict:
    """A small JSON cache file's object: empty where the file is missing, unreadable or not
    an object (data, never trusted: callers keep only the values they can use)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache_dict(path: Path, data: dict, indent: int | None = None) -> None:
    """Write ``data`` to ``path`` whole (a temporary file moved over it: a reader never sees
    half); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)


def put_latest(path: Path, entries: dict, key: str, value: object, kept: int) -> None:
    """Write ``with_latest(...)`` whole; best effort: a file that cannot be written stays as
    it was."""
    try:
        write_cache_dict(path, with_latest(entries, key, value, kept))
    except OSError:
        pass


def with_latest(entries: dict, key: str, value: object, kept: int) -> dict:
    """``entries`` with ``key`` set to ``value`` (last), only the latest ``kept`` entries."""
    entries = {k: v for k, v in entries.items() if k != key}
    return dict(list(entries.items())[-(kept - 1) :]) | {key: value}


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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Memory budget for the KV cache; None sizes it from ``num_blocks`` or the context length."""
    num_blocks: int | None = None
    """Force an exact number of KV blocks (tests use this to force preemption)."""
    enable_prefix_caching: bool = True
    state_checkpoints: int | None = None
    """Models with state layers: request states kept at block boundaries for the prefix cache
    (``core.state_prefix``); None: two per seat within a quarter of the default KV budget; 0:
    none, so such a model computes every prompt in full."""

    def __post_init__(self) -> None:
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints must be >= 0, got {self.state_checkpoints}")
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
    long_prefill_token_threshold: int | None = None
    """Most prompt tokens one request computes in a step (vLLM's name), so a long prompt is
    spread over steps and a request that arrives meanwhile starts in the next one. None: a
    quarter of ``max_num_batched_tokens``, at least 512; 0: no cap."""
    prompt_logprob_token_weight: float = 1.4
    """What a prompt token whose logprobs are wanted costs, in step budget and chunk cap, next
    to a plain prefill token: it adds an LM head over the vocabulary, a float32 log-softmax
    and a top-k (1.30-1.40 measured on the demo model's 512-token prefill, top 1 and 20, on
    1 and 2 CPU threads, eager and compiled). With ``max_step_ms``, the weight until the
    step-cost fit has learnt it from the steps run (``core.step_cost``)."""
    max_step_ms: float | None = None
    """Longest a step should run, in ms: the step's token budget is what the fitted step cost
    says fits (``core.step_cost``), so a request arriving mid-step waits at most about this long
    for a seat, and a running stream's inter-token gap stays near it. None or 0: no time cap
    (throughput first: the offline default; the server's is ``--max-step-ms``)."""
    reserved_seats: int | None = None
    """Seats (of ``max_num_seqs``) that only a client's or a call's first live sequence may
    take, the last half of them (rounded up) only a client's: a client's later calls never
    fill those, so a new client finds a seat, and a call's later prompts and completions none
    of them, so a new call finds one. None: ``max_num_seqs // 16``, at least 1; fewer than
    ``max_num_seqs``."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
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
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"
    quantization: str | None = None
    """vLLM's ``quantization``: None or ``auto`` serves the checkpoint's own
    (``quantization_config``); a method name must match it (``models.quant_config``)."""
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
