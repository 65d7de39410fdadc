"""A.X-K1 (SK Telecom, ``AXK1ForCausalLM``): DeepSeek-V3 (multi-head latent attention with a
query LoRA always, sigmoid group routing, shared experts), dense layers named by
``mlp_layer_types`` (else the first ``first_k_dense_replace``, default one), and one addition:
an RMSNorm (``post_mlp_layernorm``) on the sparse MoE block's output, before the residual.
Releases store that norm on every layer; a dense layer's is unused (as in transformers)."""

from __future__ import annotations

import re

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.deepseek import DeepseekV3ForCausalLM
from warmboot.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from warmboot.models.layers.moe import SparseMoE

_POST_NORM = re.compile(r"^model\.layers\.(\d+)\.(?:mlp\.)?post_mlp_layernorm\.")


class PostNormedMoE(SparseMoE):
    """A sparse MoE block whose output (routed plus shared) is RMS-normalised."""

    def __init__(self, moe: SparseMoE, norm: nn.Module):
        super().__init__(moe.gate, moe.experts, moe.shared_expert)
        self.post_mlp_layernorm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(super().forward(x))


class AXK1ForCausalLM(Glm4MoeLiteForCausalLM):
    defaults = dict(first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    renames = (
        (r"^model\.layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.mlp.post_mlp_layernorm."),
        *Glm4MoeLiteForCausalLM.renames,
    )
    """Releases keep the norm on the layer, transformers' modules on the MoE block."""

    def __init__(self, cfg: ModelConfig):
        if not cfg.get("q_lora_rank"):
            raise UnsupportedModelError(f"{cfg.architecture}: q_lora_rank is required")
        first = cfg.get("first_k_dense_replace", 1)
        dense_first = ["dense" if i < first else "sparse" for i in range(cfg.num_layers)]
        self.mlp_types = cfg.get("mlp_layer_types") or dense_first
        if len(self.mlp_types) != cfg.num_layers or set(self.mlp_types) - {"dense", "sparse"}:
            raise UnsupportedModelError(f"{cfg.architecture}: mlp_layer_types {self.mlp_types}")
        DeepseekV3ForCausalLM.__init__(self, cfg)

    def make_mlp(self, index: int) -> nn.Module:
        mlp = super().make_mlp(index)
        if self.mlp_types[index] == "dense":
            return mlp
        return PostNormedMoE(mlp, self.make_norm(self.cfg.hidden_size))

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        norm = _POST_NORM.match(name)
        if norm and self.mlp_types[int(norm[1])] == "dense":
            return None  # NOTE: stored for dense layers too, unused there
        return super().map_name(name)

    def tie_weights(self) -> None:
        """Releases route without ``e_score_correction_bias``: zeros, as transformers' init."""
        super().tie_weights()
        like = self.embed_tokens.weight
        for mlp in (layer.mlp for layer in self.layers):
            bias = getattr(getattr(mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None and bias.is_meta:
                zeros = torch.zeros(bias.shape, dtype=like.dtype, device=like.device)
                mlp.gate.e_score_correction_bias = nn.Parameter(zeros, requires_grad=False)
