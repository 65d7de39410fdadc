"""Granite (IBM): Llama with multipliers on the embeddings, the residual branches and the
attention scores, and logits divided by ``logits_scaling``."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_scale = cfg.get("embedding_multiplier", 1.0)
        self.logits_scaling = cfg.get("logits_scaling", 1.0)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        spec = AttentionSpec(scale=cfg.get("attention_multiplier", cfg.head_dim**-0.5))
        return DecoderLayer(
            self.attention(index, spec=spec, **self.attention_options()),
            self.make_mlp(),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
            residual_scale=cfg.get("residual_multiplier", 1.0),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
