"""OLMoE: Llama's pre-norm layers with q/k RMSNorm over the whole projection (before the head
split) and sparse MoE blocks (softmax then top-k, renormalised when ``norm_topk_prob``)."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.olmo2 import Olmo2ForCausalLM


class OlmoeForCausalLM(LlamaForCausalLM):
    def attention_options(self) -> dict:
        clip = self.cfg.get("clip_qkv")
        if clip is not None:  # NOTE: OLMoE clamps q/k after their norms
            raise UnsupportedModelError(f"OLMoE with clip_qkv={clip} is not supported")
        return Olmo2ForCausalLM.attention_options(self, 0)  # q/k norms over the projection

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, hidden = cfg.get("num_experts"), cfg.hidden_size
        renormalize = bool(cfg.get("norm_topk_prob", False))
        return SparseMoE(
            Router(hidden, experts, cfg.get("num_experts_per_tok"), renormalize=renormalize),
            FusedExperts(
                experts, hidden, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
            ),
        )
