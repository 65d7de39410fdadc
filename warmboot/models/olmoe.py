"""OLMoE: Llama's pre-norm layers with q/k RMSNorm over the whole projection (before the head
split) and sparse MoE blocks (softmax then top-k, renormalised when ``norm_topk_prob``)."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.registry import UnsupportedModelError


class OlmoeForCausalLM(LlamaForCausalLM):
    def attention_options(self) -> dict:
        cfg = self.cfg
        if cfg.get("clip_qkv") is not None:  # NOTE: OLMoE clamps q/k after their norms
            raise UnsupportedModelError(
                f"OLMoE with clip_qkv={cfg.get('clip_qkv')} is not supported"
            )
        bias = bool(cfg.get("attention_bias", False))
        return dict(
            qkv_bias=bias,
            o_bias=bias,
            q_norm=self.make_norm(cfg.q_size),
            k_norm=self.make_norm(cfg.kv_size),
            norm_before_split=True,
        )

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
