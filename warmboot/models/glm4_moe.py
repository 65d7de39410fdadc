"""GLM-4.5 (``Glm4MoeForCausalLM``): DeepSeek-V3's MoE blocks (dense first layers, sigmoid
routing with ``e_score_correction_bias``, groups, shared experts) over standard GQA attention:
q/k/v biases with ``attention_bias`` (o_proj none), optional per-head q/k RMSNorm
(``use_qk_norm``), rope on the first half of each head (``partial_rotary_factor``, default
0.5) with rotate-half pairing. Its multi-token-prediction layers are not read."""

from __future__ import annotations

from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import KVLayout
from warmboot.models.base import STACKED, CausalLM
from warmboot.models.deepseek import DeepseekV3ForCausalLM


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    stacked = STACKED
    defaults = dict(first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True)

    @classmethod
    def check_attention(cls, cfg: ModelConfig, refuse) -> None:
        pass  # NOTE: standard attention: nothing beyond the common config fields

    def make_attention(self, index: int) -> nn.Module:
        cfg = self.cfg
        options = dict(qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=False)
        if cfg.get("use_qk_norm", False):
            d = cfg.head_dim
            options.update(q_norm=self.make_norm(d), k_norm=self.make_norm(d))
        partial = cfg.get("partial_rotary_factor", 0.5)
        rope = self.shared_rope(self.rope_spec(partial_rotary_factor=partial))
        return self.attention(index, rope=rope, **options)

    def rope_interleaved(self) -> bool:
        return False

    def kv_layout(self) -> KVLayout:
        return CausalLM.kv_layout(self)
