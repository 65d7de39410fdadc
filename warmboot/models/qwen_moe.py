"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention over sparse MoE blocks (softmax then
top-k, renormalised when ``norm_topk_prob``). A layer is sparse unless it is listed in
``mlp_only_layers`` or falls between every ``decoder_sparse_step``-th layer; the others keep
a dense MLP of ``intermediate_size``. Qwen2-MoE adds a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import Qwen2ForCausalLM, Qwen3ForCausalLM


class QwenMoeMixin:
    """Chooses each layer's MLP; ``shared_expert`` when the config sizes one."""

    def sparse(self, index: int) -> bool:
        cfg = self.cfg
        experts = cfg.get("num_experts") or cfg.get("num_local_experts", 0)
        return (
            index not in (cfg.get("mlp_only_layers") or [])
            and experts > 0
            and (index + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )

    def renormalize(self) -> bool:
        return bool(self.cfg.get("norm_topk_prob", False))

    def make_mlp(self, index: int) -> nn.Module:
        if not self.sparse(index):
            return super().make_mlp(index)
        cfg = self.cfg
        experts = cfg.get("num_experts") or cfg.get("num_local_experts", 0)
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        shared_size = cfg.get("shared_expert_intermediate_size") or 0
        renormalize = self.renormalize()
        return SparseMoE(
            Router(hidden, experts, cfg.get("num_experts_per_tok"), renormalize=renormalize),
            FusedExperts(experts, hidden, cfg.get("moe_intermediate_size"), act),
            GatedMLP(hidden, shared_size, act) if shared_size else None,
            Linear(hidden, 1) if shared_size else None,
        )


class Qwen2MoeForCausalLM(QwenMoeMixin, Qwen2ForCausalLM):
    pass


class Qwen3MoeForCausalLM(QwenMoeMixin, Qwen3ForCausalLM):
    pass
