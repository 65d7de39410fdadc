"""HyperCLOVA X (Naver): Granite's multipliers on the embeddings, the residual branches and the
attention scores, with Peri-LN (``use_post_norm``: an RMSNorm on each sublayer's output,
``post_norm1``/``post_norm2``, before its residual scale) and logits *multiplied* by
``logits_scaling`` (Granite divides)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels.backend import AttentionSpec
from warmboot.models.granite import GraniteForCausalLM
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.llama import LlamaForCausalLM


class PeriNormDecoderLayer(DecoderLayer):
    """``x + s * post_norm1(attn(norm(x)))``, then ``x + s * post_norm2(mlp(norm(x)))``."""

    def __init__(self, self_attn, mlp, *norms: nn.Module, residual_scale: float):
        super().__init__(self_attn, mlp, norms[0], norms[1], residual_scale)
        self.post_norm1, self.post_norm2 = norms[2], norms[3]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        x = x + self.post_norm1(h) * self.residual_scale
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.post_norm2(h) * self.residual_scale


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if not cfg.hf.get("use_post_norm", True):
            return super().make_layer(index)
        spec = AttentionSpec(scale=cfg.get("attention_multiplier", cfg.head_dim**-0.5))
        norms = [self.make_norm(cfg.hidden_size) for _ in range(4)]
        return PeriNormDecoderLayer(
            self.attention(index, spec=spec, **self.attention_options()),
            self.make_mlp(index),
            *norms,
            residual_scale=cfg.get("residual_multiplier", 1.0),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return LlamaForCausalLM.compute_logits(self, hidden) * self.logits_scaling
