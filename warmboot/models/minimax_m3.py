"""MiniMax-M3 (``MiniMaxM3VLForCausalLM``, ``minimax_m3_vl_text``): pre-norm layers with
Gemma's ``1 + w`` RMSNorms, per-head q/k norms, partial rope, and

- attention dense (``full_attention``) or block-sparse (``minimax_m3_sparse``): an indexer with
  one query per KV head picks ``index_topk_blocks`` blocks of ``index_block_size`` positions,
  the ``index_local_blocks`` ending at the query's own among them (``layers.indexer``);
- an MLP per ``mlp_layer_types``: ``dense`` (``dense_intermediate_size``) or ``sparse``: routed
  experts (sigmoid scores, ``e_score_correction_bias`` for the choice, the chosen weights
  renormalised, the sum times ``routed_scaling_factor``) plus a shared expert; every MLP and
  expert with GPT-OSS's clamped SwiGLU on gate/up halves (not interleaved).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.base import EXPERT_PROJECTIONS, CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attention
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.indexer import BlockIndexedAttention, BlockIndexer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE, clamped_swiglu
from warmboot.models.layers.norm import GemmaRMSNorm

SPARSE, FULL = "minimax_m3_sparse", "full_attention"


class ClampedSwigluMLP(GatedMLP):
    """A gated MLP whose activation takes gate and up together (``clamped_swiglu``)."""

    def __init__(self, hidden: int, intermediate: int, act_and_mul):
        super().__init__(hidden, intermediate, "silu")
        self.act_and_mul = act_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class MiniMaxM3VLForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        # NOTE: the release's own names (a multimodal checkpoint as MiniMax saves it)
        (r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.self_attn\.index_([qk])_(proj|norm)\.", r".self_attn.indexer.\1_\2."),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.indexer\.([qk])_proj\.", r".indexer.w\1."),
    )
    expert_projections = EXPERT_PROJECTIONS | {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
    }

    def __init__(self, cfg: ModelConfig):
        _check(cfg)
        super().__init__(cfg)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return GemmaRMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def make_layer(self, index: int) -> nn.Module:
        size = self.cfg.hidden_size
        return DecoderLayer(
            self.make_attention(index),
            self.make_mlp(index),
            self.make_norm(size),
            self.make_norm(size),
        )

    def make_attention(self, index: int) -> Attention:
        cfg, d = self.cfg, self.cfg.head_dim
        rope = self.shared_rope(self.rope_spec())
        options = dict(q_norm=self.make_norm(d), k_norm=self.make_norm(d))
        if _layer_types(cfg)[index] != SPARSE:
            return self.attention(index, **options)
        indexer = BlockIndexer(
            cfg.hidden_size, cfg.num_kv_heads, cfg.get("index_head_dim"), self.make_norm, rope
        )
        return BlockIndexedAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            rope=rope,
            spec=AttentionSpec(scale=d**-0.5),
            indexer=indexer,
            topk=cfg.get("index_topk_blocks"),
            block=cfg.get("index_block_size"),
            local=cfg.get("index_local_blocks"),
            **options,
        )

    def sliding_window(self, index: int) -> int | None:
        return None

    def make_mlp(self, index: int) -> nn.Module:
        cfg, hidden = self.cfg, self.cfg.hidden_size
        act = clamped_swiglu(cfg.get("swiglu_alpha", 1.702), cfg.get("swiglu_limit", 7.0))
        if _mlp_types(cfg)[index] == "dense":
            return ClampedSwigluMLP(hidden, cfg.get("dense_intermediate_size"), act)
        experts = cfg.get("num_local_experts")
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=True,
            correction_bias=True,
            scale=float(cfg.get("routed_scaling_factor", 2.0)),
            float32=True,
        )
        return SparseMoE(
            router,
            FusedExperts(experts, hidden, cfg.get("intermediate_size"), act_and_mul=act),
            ClampedSwigluMLP(hidden, cfg.get("shared_intermediate_size"), act),
        )

    def kv_layout(self) -> KVLayout:
        """K/V and, where a layer is sparse, the indexer's key per token."""
        layout = super().kv_layout()
        if SPARSE not in _layer_types(self.cfg):
            return layout
        return dataclasses.replace(layout, index_dim=self.cfg.get("index_head_dim"))


def _layer_types(cfg: ModelConfig) -> list[str]:
    return list(cfg.get("layer_types") or [FULL] * cfg.num_layers)


def _mlp_types(cfg: ModelConfig) -> list[str]:
    return list(cfg.get("mlp_layer_types") or ["sparse"] * cfg.num_layers)


def _check(cfg: ModelConfig) -> None:
    def refuse(reason: str):
        raise UnsupportedModelError(f"{cfg.architecture}: unsupported {reason}")

    kinds, mlps = _layer_types(cfg), _mlp_types(cfg)
    if len(kinds) != cfg.num_layers or set(kinds) - {SPARSE, FULL}:
        refuse(f"layer_types {kinds!r} ({FULL} or {SPARSE}, one per layer)")
    if len(mlps) != cfg.num_layers or set(mlps) - {"dense", "sparse"}:
        refuse(f"mlp_layer_types {mlps!r} (dense or sparse, one per layer)")
    if SPARSE not in kinds:
        return
    for name in ("index_head_dim", "index_block_size", "index_topk_blocks"):
        if not isinstance(cfg.get(name), int) or cfg.get(name) < 1:
            refuse(f"{name} {cfg.get(name)!r} (the indexer needs it positive)")
    if cfg.get("index_n_heads") != cfg.num_kv_heads:
        refuse(f"index_n_heads {cfg.get('index_n_heads')} (one per KV head)")
    local = cfg.get("index_local_blocks", 1)
    if not 0 <= local <= cfg.get("index_topk_blocks"):
        refuse(f"index_local_blocks {local} (0 to index_topk_blocks)")
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if cfg.get("index_head_dim") < int(cfg.head_dim * partial):
        refuse("index_head_dim under the rotary dims (the indexer rotates that many)")
