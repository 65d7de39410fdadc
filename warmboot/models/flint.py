"""Flint (``FlintForCausalLM``): Qwen3-MoE's pre-norm layers and per-head q/k RMSNorm, with
a learned sink logit per head in every softmax (``self_attn.sinks``; releases name it
``softmax_offset``), windows on the ``sliding_attention`` layers, which alone are rotated
(the full layers are NoPE), and sparse blocks (dense on ``mlp_only_layers``) routed by the
float32 top-k of the logits' sigmoids (renormalised with ``norm_topk_prob``) plus an ungated
shared MLP added unscaled."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.qwen_moe import QwenMoeMixin


class FlintForCausalLM(QwenMoeMixin, LlamaForCausalLM):
    qk_norm = True
    renames = (*LlamaForCausalLM.renames, (r"\.self_attn\.softmax_offset$", ".self_attn.sinks"))

    def attention_options(self) -> dict:
        return super().attention_options() | dict(sinks=True)

    def attention(self, index: int, **kwargs) -> nn.Module:
        nope = self.sliding_window(index) is None
        return super().attention(index, **kwargs, **(dict(rope=None) if nope else {}))

    def sliding_window(self, index: int) -> int | None:
        types = self.cfg.get("layer_types")
        if types is None:  # NOTE: full on the first two, every fourth from 1 and the last
            n = self.cfg.num_layers
            sliding = not (index < 2 or index % 4 == 1 or index == n - 1)
        else:
            sliding = types[index] == "sliding_attention"
        return self.cfg.get("sliding_window", 513) if sliding else None

    def make_mlp(self, index: int) -> nn.Module:
        if not self.sparse(index):
            return LlamaForCausalLM.make_mlp(self, index)
        cfg = self.cfg
        hidden, act, experts = (
            cfg.hidden_size,
            cfg.get("hidden_act", "silu"),
            cfg.get("num_experts"),
        )
        gate = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=self.renormalize(),
            float32=True,
        )
        shared = GatedMLP(hidden, cfg.get("shared_expert_intermediate_size"), act)
        return SparseMoE(
            gate, FusedExperts(experts, hidden, cfg.get("moe_intermediate_size"), act), shared
        )
