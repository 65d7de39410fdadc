"""DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's latent attention and routing
(``models.deepseek``) with DeepSeek Sparse Attention: each layer's lightning indexer
(``layers.indexer``) picks the ``index_topk`` past positions a query attends to, and keeps one
``index_head_dim`` key per token beside the latent cache.

- V3.2: the indexer rotates half-split pairs (the latent attention interleaved ones).
- GLM-5: the indexer rotates interleaved pairs; ``indexer_types`` (or ``index_topk_pattern``,
  or ``index_topk_freq`` / ``index_skip_topk_offset``) marks ``shared`` layers, which have no
  indexer and attend over the positions the last ``full`` layer picked.
- ``mlp_layer_types`` (else ``first_k_dense_replace``) says which layers are dense.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.deepseek import DeepseekV3ForCausalLM
from warmboot.models.layers.indexer import IndexedMLAttention, Indexer

INDEXED = "indexed_attention"


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    index_interleaved = False
    """How the indexer pairs its rotated dims."""

    @classmethod
    def check_attention(cls, cfg: ModelConfig, refuse) -> None:
        super().check_attention(cfg, refuse)
        for name in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
            if not cfg.get(name) or cfg.get(name) < 1:
                refuse(f"{name} {cfg.get(name)!r} (the indexer needs it positive)")
        if cfg.get("qk_rope_head_dim") > cfg.get("index_head_dim"):
            refuse("qk_rope_head_dim above index_head_dim (the indexer rotates that many dims)")
        kinds = set(cfg.get("layer_types") or [INDEXED])
        if kinds != {INDEXED}:
            refuse(f"layer_types {sorted(kinds)} (only {INDEXED!r})")
        mlp = cfg.get("mlp_layer_types")
        if mlp is not None and (len(mlp) != cfg.num_layers or set(mlp) - {"dense", "sparse"}):
            refuse(f"mlp_layer_types {mlp!r} (dense or sparse, one per layer)")
        cls.check_indexers(cfg, refuse)

    @classmethod
    def check_indexers(cls, cfg: ModelConfig, refuse) -> None:
        return None

    def rope_interleaved(self) -> bool:
        return True

    def dense_mlp(self, index: int) -> bool:
        kinds = self.cfg.get("mlp_layer_types")
        return super().dense_mlp(index) if kinds is None else kinds[index] == "dense"

    def runs_indexer(self, index: int) -> bool:
        return True

    def make_attention(self, index: int) -> nn.Module:
        cfg = self.cfg
        nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        indexer = None
        if self.runs_indexer(index):
            spec = self.rope_spec(interleaved=self.index_interleaved)
            indexer = Indexer(
                cfg.hidden_size,
                cfg.get("q_lora_rank"),
                cfg.get("index_n_heads"),
                cfg.get("index_head_dim"),
                self.latent_rope(spec, rope),
            )
        return IndexedMLAttention(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg.get("kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=cfg.get("v_head_dim"),
            rope=self.latent_rope(self.rope_spec(interleaved=True), rope),
            spec=AttentionSpec(scale=self.softmax_scale(nope + rope)),
            bias=bool(cfg.get("attention_bias", False)),
            indexer=indexer,
            topk=cfg.get("index_topk"),
        )

    def kv_layout(self) -> KVLayout:
        """The latent cache and the indexer's key per token."""
        return dataclasses.replace(super().kv_layout(), index_dim=self.cfg.get("index_head_dim"))


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    index_interleaved = True

    @classmethod
    def check_indexers(cls, cfg: ModelConfig, refuse) -> None:
        kinds = indexer_types(cfg)
        if len(kinds) != cfg.num_layers or set(kinds) - {"full", "shared"}:
            refuse(f"indexer_types {kinds!r} (full or shared, one per layer)")
        if kinds and kinds[0] != "full":
            refuse("indexer_types: the first layer shares a selection no layer made")

    def runs_indexer(self, index: int) -> bool:
        return indexer_types(self.cfg)[index] == "full"


def indexer_types(cfg: ModelConfig) -> list[str]:
    """GLM-5's per-layer indexer modes, as its config derives them."""
    kinds = cfg.get("indexer_types")
    if kinds is not None:
        return list(kinds)
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        names = {"F": "full", "S": "shared"}
        return [names.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return [
        "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(cfg.num_layers)
    ]
