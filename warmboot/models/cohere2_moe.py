"""Command A MoE (``Cohere2MoeForCausalLM``): Cohere 2's parallel blocks (interleaved float32
rope on the windowed layers only, logits times ``logit_scale``) with sparse MoE MLPs.
It adds: per-layer ``mlp_layer_types`` (dense layers of ``prefix_dense_intermediate_size``,
rotated even without a window when ``prefix_dense_sliding_window_pattern`` is 1); routing
as top-k of the logits then a softmax over the k, or a sigmoid of the k (renormalised when
``norm_topk_prob``); shared experts summed or averaged with the routed ones
(``shared_expert_combination_strategy``); RMSNorm in place of LayerNorm when
``rms_norm_eps`` is set."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.cohere import Cohere2ForCausalLM, ParallelDecoderLayer
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm


class AveragedMoE(SparseMoE):
    """``(routed + shared) / 2``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / 2


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    renames = ((r"^model\.", ""), (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."))

    def __init__(self, cfg: ModelConfig):
        self.mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * cfg.num_layers
        combine = cfg.get("shared_expert_combination_strategy", "average")
        selection = cfg.get("expert_selection_fn", "softmax")
        if combine not in ("sum", "average") or selection not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"{cfg.architecture}: {combine!r} / {selection!r}")
        super().__init__(cfg)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        eps = self.cfg.get("rms_norm_eps")
        return super().make_norm(size) if eps is None else RMSNorm(size, eps)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        return ParallelDecoderLayer(
            self.attention(index, **self.attention_options(index)),
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
        )

    def attention_options(self, index: int) -> dict:
        options = super().attention_options(index)
        forced = self.mlp_types[index] == "dense"
        if forced and self.cfg.get("prefix_dense_sliding_window_pattern", 1) == 1:
            options.pop("rope", None)  # NOTE: transformers rotates these dense layers anyway
        return options

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        if self.mlp_types[index] == "dense":
            return GatedMLP(hidden, cfg.get("prefix_dense_intermediate_size"), act)
        experts, size = cfg.get("num_experts"), cfg.get("intermediate_size")
        if cfg.get("expert_selection_fn", "softmax") == "softmax":
            routing = dict(softmax_after_topk=True)
        else:
            routing = dict(scoring="sigmoid", renormalize=bool(cfg.get("norm_topk_prob", True)))
        shared = cfg.get("num_shared_experts") or 0
        block = AveragedMoE if shared and self._averaged() else SparseMoE
        return block(
            Router(hidden, experts, cfg.get("num_experts_per_tok"), **routing),
            FusedExperts(experts, hidden, size, act),
            GatedMLP(hidden, size * shared, act) if shared else None,
        )

    def _averaged(self) -> bool:
        return self.cfg.get("shared_expert_combination_strategy", "average") == "average"
