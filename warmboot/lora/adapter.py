"""peft's on-disk LoRA adapter -> ``Adapter``: float32 factors per base module, B pre-scaled.

Read as peft 0.21 reads it: ``adapter_config.json`` and ``adapter_model.safetensors`` (never
``adapter_model.bin``: a pickle is not unpickled). Per module, ``r`` and ``lora_alpha`` come
from ``rank_pattern``/``alpha_pattern`` (the first key ``k`` in the file's order for which
``(.*\\.)?(k)$`` matches the module name) or the defaults; the scaling is ``alpha / r``, or
``alpha / sqrt(r)`` with ``use_rslora``. The tensors present are what is applied; each must
belong to a module the config targets (peft would ignore it otherwise). What peft would apply
otherwise than ``x @ A.T @ B.T * scaling`` on a linear layer is refused, naming the field or
tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PREFIX = "base_model.model."
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Input embeddings and LM heads by their usual module names (peft targets them as lora.Embedding
# or as a Linear the engine does not LoRA).
EMBEDDING_NAMES = frozenset(
    {"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out", "word_embeddings"}
)
# Fields meaning a feature beyond plain LoRA (refused when set); values name the feature.
REFUSED_FIELDS = {
    "use_dora": "DoRA",
    "modules_to_save": "whole modules trained beside the adapter",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "replicated base layers",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on bare parameters (MoE experts)",
    "megatron_config": "Megatron parallel layers",
    "use_qalora": "QA-LoRA's pooled inputs",
    "alora_invocation_tokens": "Activated LoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "velora_config": "VeLoRA",
}
# Fields that do not change what is applied at inference (or are checked below).
KNOWN_FIELDS = frozenset(
    {
        *("peft_type", "task_type", "inference_mode", "base_model_name_or_path", "revision"),
        *("auto_mapping", "peft_version", "r", "lora_alpha", "use_rslora", "bias"),
        *("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern"),
        *("rank_pattern", "alpha_pattern", "init_lora_weights", "lora_dropout"),
        *("fan_in_fan_out", "megatron_core", "loftq_config", "eva_config", "corda_config"),
        *("lora_ga_config", "qalora_group_size", "ensure_weight_tying", "runtime_config"),
    }
)
# init_lora_weights values whose adapters belong to a base peft modified (a residual base).
MODIFIED_BASE_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


class LoraError(ValueError):
    """An adapter that cannot be served exactly; the message names the field or tensor."""


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # (r, in) float32
    b: torch.Tensor  # (out, r) float32, already multiplied by the scaling


@dataclass(frozen=True)
class Adapter:
    path: Path
    rank: int  # the largest r over its modules
    modules: dict[str, LoraModule]  # base checkpoint module name -> factors
    digest: str  # sha256 over adapter_config.json + the safetensors bytes


def load_adapter(path: str | Path, max_rank: int) -> Adapter:
    """Read the peft LoRA adapter directory ``path``; refuse ranks above ``max_rank``."""
    root = Path(path)
    try:
        config_bytes, weights_bytes = _read_files(root)
        config = _parse_config(config_bytes)
        tensors = _read_tensors(weights_bytes)
        modules = {}
        for name, (a, b) in sorted(_pair_tensors(tensors).items()):
            _check_target(config, name)
            modules[name] = _module(config, name, a, b, max_rank)
    except LoraError as exc:
        raise LoraError(f"LoRA adapter {root}: {exc}") from None
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    rank = max(m.a.shape[0] for m in modules.values())
    return Adapter(path=root, rank=rank, modules=modules, digest=digest.hexdigest())


def _read_files(root: Path) -> tuple[bytes, bytes]:
    if not root.is_dir():
        raise LoraError("not a directory")
    if not (root / CONFIG_FILE).is_file():
        raise LoraError(f"no {CONFIG_FILE}")
    if not (root / WEIGHTS_FILE).is_file():
        if (root / PICKLE_FILE).is_file():
            raise LoraError(
                f"no {WEIGHTS_FILE}; {PICKLE_FILE} is a pickle and is not read (save the adapter "
                "with peft's save_pretrained(safe_serialization=True))"
            )
        raise LoraError(f"no {WEIGHTS_FILE}")
    try:
        return (root / CONFIG_FILE).read_bytes(), (root / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise LoraError(f"cannot read its files: {exc}") from None


def _parse_config(data: bytes) -> dict:
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise LoraError(f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise LoraError(f"peft_type={config.get('peft_type')!r}: only LORA adapters are served")
    for field, feature in REFUSED_FIELDS.items():
        if config.get(field):
            raise LoraError(f"{field}={config[field]!r} ({feature}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"bias={config['bias']!r} (trained base biases) is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(MODIFIED_BASE_INITS):
        raise LoraError(
            f"init_lora_weights={init!r}: the adapter goes with a base peft modified; convert it "
            "(save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
    for field, value in config.items():
        if field not in KNOWN_FIELDS and field not in REFUSED_FIELDS and value:
            raise LoraError(f"unknown field {field}={value!r} (written by a newer peft?)")
    _check_types(config)
    return config


def _check_types(config: dict) -> None:
    _rank(config.get("r", 8), "r")
    _alpha(config.get("lora_alpha", 8), "lora_alpha")
    if not isinstance(config.get("use_rslora", False), bool):
        raise LoraError(f"use_rslora={config['use_rslora']!r} is not a boolean")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise LoraError(f"{field}={pattern!r} is not an object")
        for key, value in pattern.items():
            _regex(key, field)
            (_rank if field == "rank_pattern" else _alpha)(value, f"{field}[{key!r}]")
    _check_target_fields(config)


def _check_target_fields(config: dict) -> None:
    """target_modules/exclude_modules/layers_*: types, and what peft itself refuses."""
    for field in ("target_modules", "exclude_modules", "layers_pattern"):
        value = config.get(field)
        if isinstance(value, str):
            _regex(value, field)
        elif value is not None and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise LoraError(f"{field}={value!r} is not a string or a list of strings")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if target.rsplit(".", 1)[-1] in EMBEDDING_NAMES:
                raise LoraError(
                    f"target_modules names {target!r}: LoRA on embeddings or the LM head is not "
                    "supported"
                )
    layers = config.get("layers_to_transform")
    if isinstance(targets, str) and (layers is not None or config.get("layers_pattern")):
        raise LoraError(
            "layers_to_transform/layers_pattern with a regex target_modules (peft refuses)"
        )
    if config.get("layers_pattern") and layers is None:
        raise LoraError("layers_pattern without layers_to_transform (peft refuses)")
    if layers is not None and not _is_int(layers):
        if not (isinstance(layers, list) and all(_is_int(v) for v in layers)):
            raise LoraError(f"layers_to_transform={layers!r} is not an integer or a list of them")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rank(value, field: str) -> int:
    if not _is_int(value) or value <= 0:
        raise LoraError(f"{field}={value!r} is not a positive integer")
    return value


def _alpha(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoraError(f"{field}={value!r} is not a finite number")
    return value


def _regex(pattern: str, field: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise LoraError(f"{field}: {pattern!r} is not a regular expression ({exc})") from None


def _read_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError(f"{WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    if not tensors:
        raise LoraError(f"{WEIGHTS_FILE} holds no tensors")
    return tensors


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Module name -> (lora_A.weight, lora_B.weight); any other tensor refused by name."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):
        module, _, leaf = key.removeprefix(PREFIX).rpartition(".")
        module, _, factor = module.rpartition(".")
        if "lora_embedding_" in key or module.rsplit(".", 1)[-1] in EMBEDDING_NAMES:
            raise LoraError(f"tensor {key}: LoRA on embeddings or the LM head is not supported")
        if "lora_magnitude_vector" in key:
            raise LoraError(f"tensor {key}: DoRA is not supported")
        if factor == "lora_B" and leaf == "bias":
            raise LoraError(f"tensor {key}: a bias on lora_B (lora_bias) is not supported")
        if not key.startswith(PREFIX) or factor not in ("lora_A", "lora_B") or leaf != "weight":
            raise LoraError(
                f"tensor {key}: not a peft LoRA factor "
                f"({PREFIX}<module>.lora_A.weight or .lora_B.weight)"
            )
        if tensor.dtype not in DTYPES:
            raise LoraError(f"tensor {key}: dtype {tensor.dtype} (float32/bfloat16/float16 only)")
        pairs.setdefault(module, {})[factor] = tensor
    for module, factors in pairs.items():
        for factor in ("lora_A", "lora_B"):
            if factor not in factors:
                raise LoraError(f"tensor {PREFIX}{module}.{factor}.weight is missing")
    return {module: (f["lora_A"], f["lora_B"]) for module, f in pairs.items()}


def _check_target(config: dict, name: str) -> None:
    """Refuse a module peft would not give this adapter (peft's target matching)."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and re.fullmatch(excluded, name):
        raise LoraError(f"module {name} is excluded by exclude_modules={excluded!r}")
    if isinstance(excluded, list) and _names_match(excluded, name):
        raise LoraError(f"module {name} is excluded by exclude_modules={excluded!r}")
    targets = config.get("target_modules")
    if targets is None:
        return  # peft takes its per-architecture default: the tensors decide
    if isinstance(targets, str):
        if targets.lower() != "all-linear" and not re.fullmatch(targets, name):
            raise LoraError(f"module {name} does not match target_modules={targets!r}")
        return
    if not _names_match(targets, name):
        raise LoraError(f"module {name} is not in target_modules={targets!r}")
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return
    index = _layer_index(name, config.get("layers_pattern"))
    if index is None or index not in (layers if isinstance(layers, list) else [layers]):
        raise LoraError(f"module {name} is not in layers_to_transform={layers!r}")


def _names_match(names: list[str], module: str) -> bool:
    return any(module == n or module.endswith(f".{n}") for n in names)


def _layer_index(name: str, patterns) -> int | None:
    """The first numbered segment after a layer-list name, as peft finds it."""
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(\d+)\.", name)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(\d+)\.", name)
            if match:
                break
    return int(match.group(1)) if match else None


def _pattern_value(pattern: dict | None, name: str, default):
    """peft's rank_pattern/alpha_pattern lookup: first key (file order) ending ``name``."""
    for key in pattern or {}:
        if re.match(rf"(.*\.)?({key})$", name):
            return pattern[key]
    return (pattern or {}).get(name, default)


def _module(config: dict, name: str, a: torch.Tensor, b: torch.Tensor, max_rank: int) -> LoraModule:
    r = _pattern_value(config.get("rank_pattern"), name, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern"), name, config.get("lora_alpha", 8))
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
        raise LoraError(
            f"module {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have "
            f"the shapes (r, in) and (out, r) with r={r} from the config"
        )
    if r > max_rank:
        raise LoraError(f"module {name}: r={r} is above max_lora_rank={max_rank}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
    a = a.to(torch.float32).contiguous()
    b = (b.to(torch.float32) * scaling).contiguous()
    for factor, tensor in (("lora_A", a), ("lora_B", b)):
        if not bool(torch.isfinite(tensor).all()):
            raise LoraError(f"tensor {PREFIX}{name}.{factor}.weight holds non-finite values")
    return LoraModule(a=a, b=b)
