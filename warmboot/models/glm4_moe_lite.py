"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3 (multi-head latent attention,
sigmoid routing with ``e_score_correction_bias``, groups, shared experts) whose dense layers
are named per layer by ``mlp_layer_types`` ("dense" | "sparse") instead of
``first_k_dense_replace``."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.deepseek import DeepseekV3ForCausalLM
from warmboot.models.layers.activation import GatedMLP


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    defaults = dict(first_k_dense_replace=0, routed_scaling_factor=1.8, norm_topk_prob=True)

    def __init__(self, cfg: ModelConfig):
        n = cfg.num_layers
        self.mlp_types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        if len(self.mlp_types) != n or set(self.mlp_types) - {"dense", "sparse"}:
            raise UnsupportedModelError(f"{cfg.architecture}: mlp_layer_types {self.mlp_types}")
        super().__init__(cfg)

    def setting(self, name: str):
        return 0 if name == "first_k_dense_replace" else super().setting(name)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.mlp_types[index] == "sparse":
            return super().make_mlp(index)
        act, size = cfg.get("hidden_act", "silu"), cfg.get("intermediate_size")
        return GatedMLP(cfg.hidden_size, size, act, bool(cfg.get("mlp_bias", False)))
