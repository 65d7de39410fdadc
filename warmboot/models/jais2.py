"""Jais 2: Llama with LayerNorms (with biases), a plain squared-ReLU MLP (``up_proj``,
``down_proj``) and biases on every projection by default (``attention_bias``, ``mlp_bias``)."""

from __future__ import annotations

from torch import nn

from warmboot.models.base import STACKED
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.llama import LlamaForCausalLM


class Jais2ForCausalLM(LlamaForCausalLM):
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """q/k/v stacked; ``up_proj`` is the plain MLP's, not a gate/up shard."""

    def attention_options(self) -> dict:
        bias = bool(self.cfg.hf.get("attention_bias", True))
        return dict(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "relu2"), bool(cfg.hf.get("mlp_bias", True))
        return MLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("layer_norm_eps", 1e-5))
