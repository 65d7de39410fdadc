"""Mixtral: Llama whose MLP is a sparse block of ``num_local_experts`` gated experts, each
token's ``num_experts_per_tok`` picked by softmax then top-k, their weights renormalised."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    renames = ((r"^model\.", ""), (r"\.block_sparse_moe\.", ".mlp."))
    expert_projections = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
    }

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, top_k = cfg.get("num_local_experts"), cfg.get("num_experts_per_tok")
        return SparseMoE(
            Router(cfg.hidden_size, experts, top_k, renormalize=True),
            FusedExperts(
                experts,
                cfg.hidden_size,
                cfg.get("intermediate_size"),
                cfg.get("hidden_act", "silu"),
            ),
        )
