"""dots.llm1 (``Dots1ForCausalLM``): DeepSeek-V3's MoE blocks (dense first layers, sigmoid
routing with ``e_score_correction_bias``, groups, shared experts; as GLM-4.5) over Qwen3's
attention: per-head q/k RMSNorm, full rotary, windows on the ``sliding_attention`` layers."""

from __future__ import annotations

from torch import nn

from warmboot.models.glm4_moe import Glm4MoeForCausalLM


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    defaults = dict(first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False)

    def make_attention(self, index: int) -> nn.Module:
        cfg, d = self.cfg, self.cfg.head_dim
        bias = bool(cfg.get("attention_bias", False))
        norms = dict(q_norm=self.make_norm(d), k_norm=self.make_norm(d))
        return self.attention(index, qkv_bias=bias, o_bias=bias, **norms)

    def sliding_window(self, index: int) -> int | None:
        cfg = self.cfg
        if cfg.get("layer_types") is None:  # NOTE: transformers' default layer types
            first = cfg.get("max_window_layers", cfg.num_layers)
            return cfg.get("sliding_window") if index >= first else None
        return super().sliding_window(index)
