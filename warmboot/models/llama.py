"""Llama and the families that are Llama with other defaults: Mistral (every layer windowed),
Qwen2 (q/k/v biases, windows from ``layer_types``), Qwen3 (per-head q/k RMSNorm)."""

from __future__ import annotations

from torch import nn

from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        return DecoderLayer(
            self.attention(index, **self.attention_options()),
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
        )

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("attention_bias", False))
        options = dict(qkv_bias=bias, o_bias=bias)
        if self.qk_norm:
            d = self.cfg.head_dim
            options.update(q_norm=self.make_norm(d), k_norm=self.make_norm(d))
        return options

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "silu"), bool(cfg.get("mlp_bias", False))
        return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_options(self) -> dict:
        return super().attention_options() | dict(qkv_bias=True, o_bias=False)

    def sliding_window(self, index: int) -> int | None:
        cfg = self.cfg
        if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
            return None
        types = cfg.get("layer_types")
        if types is None:  # NOTE: older configs: the layers from max_window_layers on
            first = cfg.get("max_window_layers", cfg.num_layers)
            return cfg.get("sliding_window") if index >= first else None
        return super().sliding_window(index)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qk_norm = True

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("attention_bias", False))
        return LlamaForCausalLM.attention_options(self) | dict(qkv_bias=bias, o_bias=bias)
