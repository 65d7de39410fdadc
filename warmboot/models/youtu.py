"""Youtu-LLM (Tencent): DeepSeek-V3's multi-head latent attention (latent KV cache, optional
low-rank query, interleaved rope unless ``rope_interleave`` is false, yarn's softmax scale)
over dense pre-norm blocks: a bias-free gated MLP on every layer, no experts; the head tied
by default."""

from __future__ import annotations

from torch import nn

from warmboot.config import ModelConfig
from warmboot.models.deepseek import DeepseekV3ForCausalLM, _refuser
from warmboot.models.layers.activation import GatedMLP


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    tied_by_default = True

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        cls.check_attention(cfg, _refuser(cfg.architecture))  # NOTE: no experts to check

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )
