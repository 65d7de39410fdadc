"""warmboot: an LLM inference server for GPUs that are started and stopped on demand.

The public names are imported lazily, so ``import warmboot.<light module>`` (the launcher, the
tokenizer) does not pay for importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "warmboot.engine.llm",
    "SamplingParams": "warmboot.sampling_params",
    "RequestOutput": "warmboot.outputs",
    "CompletionOutput": "warmboot.outputs",
    "Logprob": "warmboot.outputs",
    "OutputFolder": "warmboot.outputs",
    "LoRARequest": "warmboot.lora_request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'warmboot' has no attribute {name!r}")
