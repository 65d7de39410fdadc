"""Solar Open (Upstage): GLM-4.5's MoE blocks (sigmoid routing with
``e_score_correction_bias``, groups scored by their best two, renormalised, scaled, shared
experts) on every layer, over Llama's attention: q/k/v biases with ``attention_bias`` (o_proj
none), no q/k norms, the config's rope (whole heads by default)."""

from __future__ import annotations

from torch import nn

from warmboot.models.glm4_moe import Glm4MoeForCausalLM


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    defaults = dict(first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=True)

    def setting(self, name: str):
        if name == "first_k_dense_replace":
            return 0  # NOTE: transformers' SolarOpenConfig has no dense layers (nor reads it)
        return super().setting(name)

    def make_attention(self, index: int) -> nn.Module:
        bias = bool(self.cfg.get("attention_bias", False))
        return self.attention(index, qkv_bias=bias, o_bias=False)
