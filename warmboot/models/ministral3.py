"""Ministral 3: Mistral without biases (a window on every layer when the config has one) whose
queries are scaled after the rope by Llama 4's position-dependent factor
``1 + beta * log(1 + floor(position / original_max_position_embeddings))`` (``beta``: the rope
parameters' ``llama_4_scaling_beta``)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.rope import LENGTH_SHIFT, RopeSpec, RotaryEmbedding
from warmboot.models.llama import LlamaForCausalLM


class ScaledQueryRope(RotaryEmbedding):
    """Rotates q and k, then multiplies q by its position's Llama 4 attention scale."""

    def __init__(self, spec: RopeSpec, head_dim: int):
        super().__init__(spec, head_dim)
        self.beta = spec.get("llama_4_scaling_beta")
        self.period = spec.get("original_max_position_embeddings")
        if self.beta is None or self.period is None:
            raise UnsupportedModelError(
                "Ministral3 rope_parameters need llama_4_scaling_beta and "
                "original_max_position_embeddings (the query scale)"
            )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().forward(positions, q, k)
        pos = positions & ((1 << LENGTH_SHIFT) - 1)  # NOTE: without a packed prompt length
        scale = 1 + self.beta * torch.log(1 + torch.floor(pos / self.period))
        return q * scale[:, None, None].to(q.dtype), k


class Ministral3ForCausalLM(LlamaForCausalLM):
    rope_class = ScaledQueryRope

    def attention_options(self) -> dict:
        return super().attention_options() | dict(qkv_bias=False, o_bias=False)

    def sliding_window(self, index: int) -> int | None:
        return self.cfg.get("sliding_window")  # NOTE: transformers ignores layer_types here

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )
