"""The model class that serves an architecture (``warmboot.architectures`` says which are
served): its family module is imported on first use."""

from __future__ import annotations

import importlib

from warmboot.architectures import ARCHITECTURES


def model_class(architecture: str) -> type:
    """The ``CausalLM`` subclass serving ``architecture`` (imports its family module)."""
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"warmboot.models.{module}"), name)
