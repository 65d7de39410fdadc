"""The pre-norm decoder layer most families share: ``x + attn(norm(x))``, then
``x + mlp(norm(x))``, each branch optionally scaled (Granite's ``residual_multiplier``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from warmboot.models.layers.attention import Attend


class DecoderLayer(nn.Module):
    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
        residual_scale: float | None = None,
    ):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.residual_scale = residual_scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        x = x + (h if self.residual_scale is None else h * self.residual_scale)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.residual_scale is None else h * self.residual_scale)


def run_layers(layers, x, positions, step, run_layer, row: Callable | None = None):
    """``CausalLM.forward``'s layer loop: each layer given ``x`` (or ``row(i, x)``: that
    layer's own row), eagerly with the step context, or through the compiled step's
    ``run_layer`` (a compiled layer knows its number)."""
    for i, layer in enumerate(layers):
        given = x if row is None else row(i, x)
        if run_layer is not None:
            x = run_layer(layer, given, positions)
            continue
        step.layer = i
        x = layer(given, positions, step)
    return x
