"""Ministral: Llama without biases, windows on the ``sliding_attention`` layers (without
``layer_types``: on every layer when the config has a window)."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.llama import LlamaForCausalLM


class MinistralForCausalLM(LlamaForCausalLM):
    def attention_options(self) -> dict:
        return super().attention_options() | dict(qkv_bias=False, o_bias=False)

    def sliding_window(self, index: int) -> int | None:
        cfg = self.cfg
        window = cfg.hf.get("sliding_window", 4096)
        types = cfg.get("layer_types")
        return window if types is None or types[index] == "sliding_attention" else None

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )
