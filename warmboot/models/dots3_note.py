"""dots3-note's text model (``Dots3NoteForCausalLM``, ``model_type`` ``dots3_note_text``):
DeepSeek-V3's latent attention and routing, each layer one of

- ``indexed_attention``: DeepSeek Sparse Attention (GLM-5's indexer: interleaved rope on its
  first dims), each query over its ``index_topk`` best positions;
- ``sliding_attention``: the latent attention over the last ``sliding_window`` positions, in
  the layer's own shape (``per_layer_config``: heads, ranks, head dims) and rope;
- ``full_attention`` (``use_dsa: false``): dense latent attention.

The latent attention: the normed query latent times ``sqrt(hidden / q_lora_rank)`` (the
indexer reads it so too), the normed KV latent times ``sqrt(hidden / kv_lora_rank)`` (cached
so), the rotated key part RMS-normed (``k_rope_only_layernorm``) before interleaved rope, both
latent norms with ``rms_norm_eps``, the softmax scale ``(nope + rope) ** -0.5``, and each head's
output times ``sigmoid(g_proj(x))`` (one gate a head). Each layer type has its rope
(``rope_parameters`` per type, rotating ``qk_rope_head_dim`` dims). The latent cache holds one
width for every layer: a layer of a narrower latent pads its entries and queries with zeros
(the scores and the latent read back are unchanged).

MoE: V3's sigmoid routing (groups, correction bias), shared experts of
``shared_experts_intermediate_size`` each; ``mlp_layer_types``, else from
``first_k_dense_replace`` / ``moe_layer_freq`` (an interval or a per-layer list). A
config.json in the released layout (``use_dsa``, ``swa_*``, ``sliding_window_size``) is read as
transformers derives it (``dots_settings``). Multi-token-prediction tensors are not read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.deepseek import DeepseekV3ForCausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.indexer import IndexedMLAttention, Indexer
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.mla import MLAttention
from warmboot.models.layers.moe import SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec

INDEXED, SLIDING, FULL = "indexed_attention", "sliding_attention", "full_attention"
PER_LAYER = (
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
"""What ``per_layer_config`` may set per layer (the released sliding layers' shape)."""
TEXT_DEFAULTS = dict(
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    shared_experts_intermediate_size=1536,
    rms_norm_eps=1e-5,
    head_dim=256,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=64,
)
"""``Dots3NoteTextConfig``'s defaults of the settings read here without a refusal."""
SWA_DEFAULTS = dict(
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1024,
    kv_lora_rank=1024,
    head_dim=256,
    qk_nope_head_dim=192,
    v_head_dim=128,
)
"""transformers' sliding-layer shape when a config names none (its ``swa_*`` defaults)."""


class DotsLatentMixin:
    """Dots' changes to the latent attention (module docstring); entries and queries padded
    to ``width``."""

    def dots_parts(self, hidden: int, q_lora_rank: int, eps: float, width: int) -> None:
        self.q_scale = (hidden / q_lora_rank) ** 0.5
        self.kv_scale = (hidden / self.rank) ** 0.5
        self.width = width
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.k_rope_only_layernorm = RMSNorm(self.rope_dim, eps)
        self.g_proj = Linear(hidden, self.num_heads)

    def kv_layout(self) -> KVLayout:
        return KVLayout(1, 1, self.width)

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        return super().query_latent(x) * self.q_scale

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, k_pe = super().latent(x)
        return c * self.kv_scale, self.k_rope_only_layernorm(k_pe)

    def attend_latent(self, attend, query, entry, x, q_latent, positions) -> torch.Tensor:
        pad = self.width - entry.shape[-1]
        if pad:
            query, entry = F.pad(query, (0, pad)), F.pad(entry, (0, pad))
        return super().attend_latent(attend, query, entry, x, q_latent, positions)

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return super().project_out(x, o * torch.sigmoid(self.g_proj(x)).unsqueeze(-1))


class DotsMLA(DotsLatentMixin, MLAttention):
    """A sliding or full layer's latent attention."""


class DotsIndexedMLA(DotsLatentMixin, IndexedMLAttention):
    """An indexed layer's latent attention."""


class Dots3NoteForCausalLM(DeepseekV3ForCausalLM):
    defaults = dict(first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True)

    def __init__(self, cfg: ModelConfig):
        cfg = dataclasses.replace(cfg, hf=dots_settings(dict(cfg.hf), cfg.num_layers))
        self.types = list(cfg.get("layer_types"))
        self.per_layer = {int(i): dict(v) for i, v in cfg.get("per_layer_config").items()}
        super().__init__(cfg)

    # -- settings -------------------------------------------------------------------------------
    def at(self, index: int, name: str) -> Any:
        """Layer ``index``'s ``name``: its ``per_layer_config`` entry, else the config's."""
        return self.per_layer.get(index, {}).get(name, self.cfg.get(name))

    @classmethod
    def check_attention(cls, cfg: ModelConfig, refuse) -> None:
        hf = dots_settings(dict(cfg.hf), cfg.num_layers)
        types, per_layer = hf["layer_types"], hf["per_layer_config"]
        if len(types) != cfg.num_layers or set(types) - {INDEXED, SLIDING, FULL}:
            refuse(f"layer_types {types!r} ({INDEXED}, {SLIDING} or {FULL}, one per layer)")
        for i, overrides in per_layer.items():
            if set(overrides) - set(PER_LAYER):
                refuse(f"per_layer_config {sorted(set(overrides) - set(PER_LAYER))} (layer {i})")
        for kind in set(types):
            rows = [per_layer.get(str(i), {}) for i, t in enumerate(types) if t == kind]
            if any(r != rows[0] for r in rows):
                refuse(f"per_layer_config differing among the {kind} layers")
        for i in range(cfg.num_layers):
            cls.check_layer(hf, per_layer.get(str(i), {}), types[i], refuse)
        if not hf.get("n_shared_experts"):
            refuse("n_shared_experts 0 (dots3-note has a shared expert)")

    @classmethod
    def check_layer(cls, hf: dict, overrides: dict, kind: str, refuse) -> None:
        get = {**hf, **overrides}.get
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if not get(name) or get(name) < 1:
                refuse(f"{name} {get(name)!r} in a {kind} layer (positive)")
        params = hf["rope_parameters"].get(kind) or {}
        if params.get("rope_type", "default") != "default":
            refuse(f"rope_type {params.get('rope_type')!r} for {kind} layers (only default)")
        rope, head_dim = get("qk_rope_head_dim"), get("head_dim")
        if int(head_dim * (rope / head_dim)) != rope or rope % 2:
            refuse(f"qk_rope_head_dim {rope} of head_dim {head_dim} (an even rotary width)")
        if kind == INDEXED:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if not get(name) or get(name) < 1:
                    refuse(f"{name} {get(name)!r} (the indexer needs it positive)")
            if rope > get("index_head_dim"):
                refuse("qk_rope_head_dim above index_head_dim (the indexer rotates that many)")
        if kind == SLIDING and (not get("sliding_window") or get("sliding_window") < 1):
            refuse(f"sliding_window {get('sliding_window')!r}")

    def dense_mlp(self, index: int) -> bool:
        return self.cfg.get("mlp_layer_types")[index] == "dense"

    def width(self) -> int:
        """The latent cache's entry: the widest layer's latent and rotated key part."""
        n = self.cfg.num_layers
        return max(self.at(i, "kv_lora_rank") + self.at(i, "qk_rope_head_dim") for i in range(n))

    # -- composition ----------------------------------------------------------------------------
    def layer_rope(self, index: int):
        """The layer type's rope over the layer's ``qk_rope_head_dim`` dims, interleaved."""
        params = dict(self.cfg.get("rope_parameters")[self.types[index]])
        params["partial_rotary_factor"] = 1.0
        spec = RopeSpec.parse(
            params, max_position_embeddings=self.cfg.max_position_embeddings, interleaved=True
        )
        return self.latent_rope(spec, self.at(index, "qk_rope_head_dim"))

    def latent_rope(self, spec, dim: int):
        ropes = self.__dict__.setdefault("_ropes", {})
        if (spec, dim) not in ropes:
            ropes[spec, dim] = self.rope_class(spec, dim)
        return ropes[spec, dim]

    def make_attention(self, index: int) -> nn.Module:
        cfg, at, kind = self.cfg, self.at, self.types[index]
        nope, rope = at(index, "qk_nope_head_dim"), at(index, "qk_rope_head_dim")
        q_rank, rotary = at(index, "q_lora_rank"), self.layer_rope(index)
        window = at(index, "sliding_window") if kind == SLIDING else None
        kwargs = dict(
            q_lora_rank=q_rank,
            kv_lora_rank=at(index, "kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=at(index, "v_head_dim"),
            rope=rotary,
            spec=AttentionSpec(scale=(nope + rope) ** -0.5, sliding_window=window),
            bias=bool(cfg.get("attention_bias", False)),
        )
        heads = at(index, "num_attention_heads")
        if kind == INDEXED:
            indexer = Indexer(
                cfg.hidden_size,
                q_rank,
                at(index, "index_n_heads"),
                at(index, "index_head_dim"),
                rotary,
            )
            topk = at(index, "index_topk")
            attn = DotsIndexedMLA(cfg.hidden_size, heads, indexer=indexer, topk=topk, **kwargs)
        else:
            attn = DotsMLA(cfg.hidden_size, heads, **kwargs)
        attn.dots_parts(cfg.hidden_size, q_rank, cfg.get("rms_norm_eps", 1e-5), self.width())
        return attn

    def make_mlp(self, index: int) -> nn.Module:
        mlp = super().make_mlp(index)
        if isinstance(mlp, SparseMoE):
            cfg = self.cfg
            size = cfg.get("shared_experts_intermediate_size", 1536) * cfg.get("n_shared_experts")
            mlp.shared_expert = GatedMLP(cfg.hidden_size, size, cfg.get("hidden_act", "silu"))
        return mlp

    # -- facts and names ------------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        """One latent entry of ``width`` a token and layer, and the indexer's key (kept for
        every layer; only the indexed layers write theirs)."""
        index_dim = self.cfg.get("index_head_dim") if INDEXED in self.types else 0
        return KVLayout(1, 1, self.width(), index_dim=index_dim or 0)

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        if re.match(r"^model\.(language_model\.)?mtp\.", name):
            return None  # NOTE: multi-token-prediction tensors, unused in decoding
        return super().map_name(name)


def dots_settings(hf: dict, num_layers: int) -> dict:
    """``config.json`` as transformers' ``Dots3NoteTextConfig`` reads it: per-layer MLP and
    attention types, the sliding layers' shape, per-type rope (released keys included)."""
    for name, value in TEXT_DEFAULTS.items():
        hf[name] = value if hf.get(name) is None else hf[name]
    hf["mlp_bias"] = False  # NOTE: transformers' dots3-note MLPs have no biases whatever it says
    first, freq = hf.pop("first_k_dense_replace", None), hf.pop("moe_layer_freq", None)
    first, freq = 1 if first is None else first, 1 if freq is None else freq
    if hf.get("mlp_layer_types") is None:
        sparse = [
            i >= first and (bool(freq[i]) if isinstance(freq, list) else i % freq == 0)
            for i in range(num_layers)
        ]
        hf["mlp_layer_types"] = ["sparse" if s else "dense" for s in sparse]
    use_dsa = hf.get("use_dsa", None if "per_layer_config" in hf else True)
    if hf.get("moe_shared_expert_intermediate_size") is not None:
        hf["shared_experts_intermediate_size"] = hf["moe_shared_expert_intermediate_size"]
    if hf.get("sliding_window") is None:
        hf["sliding_window"] = hf.get("sliding_window_size", 512)
    types = hf.get("layer_types")
    if types is None:
        dense = FULL if use_dsa is False else INDEXED
        swa = hf.get("use_sliding_window", True)
        types = [dense if not swa or i < 2 or i % 4 == 1 else SLIDING for i in range(num_layers)]
    if use_dsa is not None:
        old, new = (FULL, INDEXED) if use_dsa else (INDEXED, FULL)
        types = [new if t == old else t for t in types]
    hf["layer_types"] = list(types)
    if "per_layer_config" not in hf:
        swa = {k: hf.get(f"swa_{k}", v) for k, v in SWA_DEFAULTS.items()}
        swa["qk_rope_head_dim"] = hf.get(
            "swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"]
        )
        hf["per_layer_config"] = {str(i): swa for i, t in enumerate(types) if t == SLIDING}
    hf["per_layer_config"] = {str(int(i)): v for i, v in (hf["per_layer_config"] or {}).items()}
    hf["rope_parameters"] = _type_ropes(hf, set(types))
    return hf


def _type_ropes(hf: dict, types: set[str]) -> dict:
    """Per layer type, its rope parameters (transformers' ``convert_rope_params_to_dict``)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    if params is None:
        theta, swa_theta = hf.get("rope_theta", 80_000_000.0), hf.get("swa_rope_theta", 50_000.0)
        params = {
            t: {"rope_type": "default", "rope_theta": swa_theta if t == SLIDING else theta}
            for t in types
        }
    if not any(isinstance(v, dict) for v in params.values()):
        params = {t: params for t in types}
    params = {t: dict(params.get(t) or {}) for t in types}
    for t in types:
        params[t].setdefault("rope_theta", hf.get("rope_theta", 80_000_000.0))
    return params
