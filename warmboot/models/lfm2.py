"""LFM2 and LFM2-MoE (Liquid AI): gated short convolutions (``conv`` layers, ``ShortConv``)
beside full attention with per-head q/k RMSNorms (``full_attention``), as ``layer_types`` lists
them (older configs: ``full_attn_idxs``). Pre-norm blocks (``operator_norm``, ``ffn_norm``),
a SwiGLU MLP (``w1``/``w3``/``w2``) whose width LFM2 adjusts (``block_auto_adjust_ff_dim``),
and a final norm stored as ``embedding_norm``. LFM2-MoE keeps its first ``num_dense_layers``
dense; the rest route by sigmoid scores with an ``expert_bias`` for the choice only,
renormalised (+1e-6) and scaled by ``routed_scaling_factor``."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from warmboot.models.base import STACKED, checked_kinds
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.short_conv import ShortConv
from warmboot.models.llama import LlamaForCausalLM

KINDS = ("conv", "full_attention")


class Lfm2ForCausalLM(LlamaForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^embedding_norm\.", "norm."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
        (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
        (r"^(layers\.\d+)\.conv\.", r"\1.self_attn."),  # NOTE: DecoderLayer's mixer
        (r"\.operator_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.", ".mlp."),
        (r"\.mlp\.w2\.", ".mlp.down_proj."),
        (r"\.mlp\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
    )
    stacked = STACKED | {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
    tied_by_default = True
    qk_norm = True

    def __init__(self, cfg):
        if cfg.hf.get("tie_embedding") is not None:  # NOTE: wins over tie_word_embeddings
            cfg = dataclasses.replace(cfg, tie_word_embeddings=bool(cfg.hf["tie_embedding"]))
        super().__init__(cfg)

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is None:
            full = cfg.get("full_attn_idxs", list(range(cfg.num_layers)))
            types = [KINDS[i in full] for i in range(cfg.num_layers)]
        return checked_kinds(types, cfg.num_layers, KINDS, "LFM2 ")

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("norm_eps", 1e-5))

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == "full_attention":
            mixer = self.attention(index, **self.attention_options())
        else:
            bias = bool(cfg.get("conv_bias", False))
            mixer = ShortConv(cfg.hidden_size, cfg.get("conv_L_cache", 3), bias)
        norm = self.make_norm
        return DecoderLayer(
            mixer, self.make_mlp(index), norm(cfg.hidden_size), norm(cfg.hidden_size)
        )

    def make_mlp(self, index: int) -> nn.Module:
        return GatedMLP(self.cfg.hidden_size, self.ffn_size(), "silu")

    def ffn_size(self) -> int:
        """``intermediate_size`` (or ``block_ff_dim``), adjusted as transformers does."""
        cfg = self.cfg
        size = cfg.get("block_ff_dim", cfg.get("intermediate_size"))
        if not cfg.get("block_auto_adjust_ff_dim", True):
            return size
        size = int(2 * size / 3)
        multiplier = cfg.hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is None:
            return size
        size, multiple = int(multiplier * size), cfg.get("block_multiple_of", 256)
        return multiple * ((size + multiple - 1) // multiple)

    def sliding_window(self, index: int) -> int | None:
        return None


class Lfm2MoeRouter(Router):
    """Sigmoid scores in the logits' dtype, chosen with the expert bias, the k weights
    renormalised with transformers' +1e-6."""

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.scale, ids


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    expert_projections = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
    }

    def ffn_size(self) -> int:
        return self.cfg.get("intermediate_size")

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        if index < cfg.get("num_dense_layers", 2):
            return super().make_mlp(index)
        hidden, experts = cfg.hidden_size, cfg.get("num_experts")
        router = Lfm2MoeRouter(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scale=cfg.get("routed_scaling_factor", 1.0),
            correction_bias=bool(cfg.get("use_expert_bias", True)),
        )
        return SparseMoE(router, FusedExperts(experts, hidden, cfg.get("moe_intermediate_size")))
