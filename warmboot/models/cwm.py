"""CWM (Code World Model): Llama without attention biases, windows on the
``sliding_attention`` layers; without ``layer_types``, every fourth layer from the first is
full attention (transformers' default), and the window defaults to 8192."""

from __future__ import annotations

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.llama import LlamaForCausalLM

DEFAULT_HEAD_DIM = 128
"""``CwmConfig``'s head size where config.json gives none (not hidden / heads)."""


class CwmForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        if cfg.hf.get("head_dim") is None and cfg.head_dim != DEFAULT_HEAD_DIM:
            raise UnsupportedModelError("Cwm config without head_dim (transformers: 128)")
        super().__init__(cfg)

    def attention_options(self) -> dict:
        return super().attention_options() | dict(qkv_bias=False, o_bias=False)

    def sliding_window(self, index: int) -> int | None:
        cfg = self.cfg
        types = cfg.get("layer_types")
        sliding = index % 4 != 0 if types is None else types[index] == "sliding_attention"
        window = cfg.hf.get("sliding_window", 8192)
        return int(window) if sliding and window else None
