"""Granite (IBM): Llama with multipliers on the embeddings, the residual branches and the
attention scores, and logits divided by ``logits_scaling``; Granite-MoE (and -Shared) the same
over sparse MoE blocks."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_scale = cfg.get("embedding_multiplier", 1.0)
        self.logits_scaling = cfg.get("logits_scaling", 1.0)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        spec = AttentionSpec(scale=cfg.get("attention_multiplier", cfg.head_dim**-0.5))
        return DecoderLayer(
            self.attention(index, spec=spec, **self.attention_options()),
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
            residual_scale=cfg.get("residual_multiplier", 1.0),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite over sparse MoE blocks: top-k of the router logits, then a softmax over the k;
    experts stored fused (``input_linear`` (E, 2I, H), gate first; ``output_linear``).
    Granite-MoE-Shared adds a dense shared MLP (``shared_mlp``) to every block."""

    renames = (
        (r"^model\.", ""),
        (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
        (r"\.block_sparse_moe\.router\.layer\.", ".mlp.gate."),
        (r"\.shared_mlp\.input_linear\.", ".mlp.shared_expert.gate_up_proj."),
        (r"\.shared_mlp\.output_linear\.", ".mlp.shared_expert.down_proj."),
    )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        experts, shared = cfg.get("num_local_experts"), cfg.get("shared_intermediate_size", 0)
        return SparseMoE(
            Router(hidden, experts, cfg.get("num_experts_per_tok"), softmax_after_topk=True),
            FusedExperts(experts, hidden, cfg.get("intermediate_size"), act),
            GatedMLP(hidden, shared, act) if shared else None,
        )


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    pass
