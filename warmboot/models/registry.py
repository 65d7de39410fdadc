"""Which model class serves a checkpoint: its config's ``architectures`` (or, lacking them,
its ``model_type``) -> a class in ``warmboot.models.<family>``. Torch-free: the config is
resolved, and an unsupported one refused, before anything heavy is imported."""

from __future__ import annotations

import importlib
from typing import Any


class UnsupportedModelError(ValueError):
    """A checkpoint warmboot cannot serve exactly (architecture, setting, tensor, format):
    refused with the reason, never served approximately."""


ARCHITECTURES: dict[str, tuple[str, str]] = {
    # architecture: (module under warmboot.models, class)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
}
"""Every architecture served; a test checks each against transformers."""

MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""``model_type`` -> architecture, for configs without ``architectures``."""


def resolve_architecture(cfg: dict[str, Any]) -> str:
    """The served architecture a config names, or ``UnsupportedModelError`` naming it."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    named = archs or f"model_type {cfg.get('model_type')!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {named}; warmboot serves {', '.join(sorted(ARCHITECTURES))}"
    )


def model_class(architecture: str) -> type:
    """The ``CausalLM`` subclass serving ``architecture`` (imports its family module)."""
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"warmboot.models.{module}"), name)
