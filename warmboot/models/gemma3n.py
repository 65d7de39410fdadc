"""Gemma 3n (text, ``gemma3n_text``): Gemma 3's sliding and full layers and per-type ropes
with

- AltUp: ``altup_num_inputs`` copies of the hidden state (the embedding and its
  magnitude-matched ``altup_projections``); each layer predicts them from each other, runs
  its blocks on the active one (``altup_active_idx``) and corrects every copy by the result;
  before the final norm the copies are merged back (``altup_unembed_projections``;
  ``layers.altup``);
- LAuReL: a low-rank branch beside attention, ``(x + attn + laurel) / sqrt(2)``;
- activation sparsity: a Gaussian top-k cut of the gates (``activation_sparsity_pattern``);
- per-layer inputs: a token embedding per layer plus a projection of the main embedding,
  gated by the corrected active copy and added to the other copies;
- KV sharing: the last ``num_kv_shared_layers`` layers read the K/V of the last earlier
  layer of their type (``AttentionSpec.kv_source``) and keep none; q, k and v normed per
  head (v without a scale), scores unscaled; RMSNorms scaled by ``w`` (not ``1 + w``).

The layers run on one row per token: the copies (n * H), then that layer's per-layer input
(P); a layer returns the copies. So a layer keeps the ``layer(x, positions, attend)`` form of
the compiled step."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.kernels.step_ops import StepContext
from warmboot.models.base import RunLayer, checked_kinds
from warmboot.models.gemma import FULL, SLIDING, Gemma3ForCausalLM
from warmboot.models.layers.activation import activation
from warmboot.models.layers.altup import (
    AltUp,
    Gemma3nRMSNorm,
    Laurel,
    SparseGatedMLP,
    expand_copies,
    merge_copies,
)
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import run_layers
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.per_layer import (
    PER_LAYER_RENAMES,
    PerLayerEmbedding,
    PerLayerInput,
    per_layer_rows,
    split_row,
)
from warmboot.models.layers.rope import RotaryEmbedding
from warmboot.models.layers.towers import hard_token_embeddings


class Gemma3nAttention(nn.Module):
    """q, k, v projected and normed per head (v without a scale), q and k rotated; a layer
    reading another's K/V (``spec.kv_source``) projects q alone and hands the step dummies
    (``StepContext.attend`` replaces them with the source's cached K/V)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        *,
        rope: RotaryEmbedding,
        spec: AttentionSpec,
        bias: bool,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.shared = spec.kv_source is not None
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(hidden, [q] if self.shared else [q, kv, kv], bias=bias)
        self.o_proj = Linear(q, hidden, bias=bias)
        self.q_norm = Gemma3nRMSNorm(head_dim, eps)
        if not self.shared:
            self.k_norm = Gemma3nRMSNorm(head_dim, eps)
            self.v_norm = Gemma3nRMSNorm(head_dim, eps, with_scale=False)
        self.rope, self.spec = rope, spec

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.num_heads * d].reshape(n, self.num_heads, d))
        if self.shared:
            q = self.rope(positions, q, q[:, :0])[0]
            k = v = q.new_zeros(n, self.num_kv_heads, d)
        else:
            k, v = qkv[:, self.num_heads * d :].reshape(n, 2, self.num_kv_heads, d).unbind(1)
            q, k = self.rope(positions, q, self.k_norm(k))
            v = self.v_norm(v)
        return self.o_proj(attend(q, k, v).reshape(n, self.num_heads * d))


class Gemma3nDecoderLayer(nn.Module):
    """AltUp's predict, then on the active copy: attention and LAuReL (averaged with the
    residual by ``1 / sqrt(2)``), the MLP, each in sandwich norms; AltUp's correct, and the
    per-layer input (gated by the scaled, corrected active copy) added to copies 1..n."""

    def __init__(self, attn, mlp, norms, altup: AltUp, laurel: Laurel, per_layer, correct_scale):
        super().__init__()
        self.self_attn, self.mlp, self.altup, self.laurel = attn, mlp, altup, laurel
        self.input_layernorm, self.post_attention_layernorm = norms[0], norms[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norms[2], norms[3]
        self.per_layer = per_layer
        self.correct_scale = correct_scale

    def forward(self, row: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        altup = self.altup
        hidden = self.input_layernorm.weight.shape[0]
        copies, per_layer_input = split_row(row, self.per_layer.per_layer_projection.in_features)
        copies = copies.reshape(-1, altup.n, hidden)
        predictions = altup.predict(copies)
        active = predictions[:, altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(normed, positions, attend))
        x = (active + attn + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = altup.correct(predictions, x)
        first = corrected[:, altup.active]
        if self.correct_scale:
            first = altup.scale_output(first)
        added = self.per_layer(first, per_layer_input)
        rest = corrected[:, 1:] + added[:, None, :]
        return torch.cat([corrected[:, :1], rest], dim=1).flatten(1)


def kv_sources(cfg: ModelConfig, types: list[str]) -> list[int | None]:
    """Per layer: the layer whose K/V it reads (transformers' ``kv_sharing_modes``: the last
    ``num_kv_shared_layers`` layers each read the last earlier layer of their type)."""
    shared = cfg.get("num_kv_shared_layers", 15) or 0
    first = cfg.num_layers - shared
    if shared and (shared < 0 or first <= 0):
        raise UnsupportedModelError(
            f"num_kv_shared_layers {shared} leaves no layer of its own K/V in {cfg.num_layers}"
        )
    sources: list[int | None] = [None] * cfg.num_layers
    for i in range(max(first, 0) if shared else cfg.num_layers, cfg.num_layers):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise UnsupportedModelError(
                f"num_kv_shared_layers {shared}: no earlier {types[i]} layer keeps K/V for layer {i}"
            )
        sources[i] = owners[-1]
    return sources


class Gemma3nForCausalLM(Gemma3ForCausalLM):
    kv_heads_default = 2
    renames = ((r"^model\.", ""), *PER_LAYER_RENAMES)

    def __init__(self, cfg: ModelConfig):
        self.types = _layer_types(cfg)
        self.sources = kv_sources(cfg, self.types)
        self.altup_inputs = _altup_inputs(cfg)
        if cfg.get("hidden_size_per_layer_input", 256) < 1:
            raise UnsupportedModelError("hidden_size_per_layer_input below 1 is not served")
        super().__init__(cfg)
        hidden = cfg.hidden_size
        self.altup_projections = nn.ModuleList(
            Linear(hidden, hidden) for _ in range(1, self.altup_inputs)
        )
        self.altup_unembed_projections = nn.ModuleList(
            Linear(hidden, hidden) for _ in range(1, self.altup_inputs)
        )
        self.per_layer_embedding = PerLayerEmbedding(
            cfg.get("vocab_size_per_layer_input", 262144),
            cfg.num_layers,
            cfg.get("hidden_size_per_layer_input", 256),
            hidden,
            self.make_norm,
        )
        self.hard_tokens = hard_token_embeddings(cfg)  # NOTE: a multimodal release's

    def make_norm(self, size: int) -> nn.Module:
        return Gemma3nRMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x if self.hard_tokens is None else self.hard_tokens(input_ids, x)

    def layer_type(self, index: int) -> str:
        return self.types[index]

    def sliding_window(self, index: int) -> int | None:
        return self.cfg.get("sliding_window", 512) if self.layer_type(index) == SLIDING else None

    def make_layer(self, index: int) -> nn.Module:
        cfg, eps = self.cfg, self.cfg.get("rms_norm_eps", 1e-6)
        hidden, n = cfg.hidden_size, self.altup_inputs
        active = cfg.get("altup_active_idx", 0)
        norms = [self.make_norm(hidden) for _ in range(4)]
        altup = AltUp(hidden, n, active, eps)
        laurel = Laurel(hidden, cfg.get("laurel_rank", 64), eps)
        size = cfg.get("hidden_size_per_layer_input", 256)
        per_layer = PerLayerInput(hidden, size, self.activation(), self.make_norm(hidden))
        correct_scale = bool(cfg.get("altup_correct_scale", True))
        return Gemma3nDecoderLayer(
            self.attention(index),
            self.make_mlp(index),
            norms,
            altup,
            laurel,
            per_layer,
            correct_scale,
        )

    def activation(self) -> str:
        name = self.cfg.get("hidden_activation", "gelu_pytorch_tanh")
        activation(name)  # NOTE: refuses an unknown one by name
        return name

    def attention(self, index: int, **kwargs) -> nn.Module:
        cfg = self.cfg
        spec = AttentionSpec(1.0, self.sliding_window(index), kv_source=self.sources[index])
        return Gemma3nAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.get("rms_norm_eps", 1e-6),
            rope=self.shared_rope(self.rope_spec(self.layer_type(index))),
            spec=spec,
            bias=bool(cfg.get("attention_bias", False)),
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        sizes = _per_layer(cfg, "intermediate_size", 16384)
        sparsity = _per_layer(cfg, "activation_sparsity_pattern", None)
        if sparsity is None:  # NOTE: transformers' default: the first 10 of more than 10
            sparsity = [
                0.95 if cfg.num_layers > 10 and i < 10 else 0.0 for i in range(cfg.num_layers)
            ]
        return SparseGatedMLP(cfg.hidden_size, sizes[index], self.activation(), sparsity[index])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        run_layer: RunLayer | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        per_layer = self.per_layer_embedding(input_ids, x)
        copies = expand_copies(self.altup_projections, x).flatten(1)
        copies = run_layers(
            self.layers, copies, positions, step, run_layer, per_layer_rows(per_layer)
        )
        copies = copies.reshape(-1, self.altup_inputs, self.cfg.hidden_size)
        return self.norm(merge_copies(self.altup_unembed_projections, copies))

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """As the base's; a shared layer's K/V projections and norms (real checkpoints keep
        them, transformers does not read them) ignored; a multimodal release's vision and
        audio vocabularies' embedders read (``layers.towers``)."""
        hard = re.match(r"^model\.(embed_vision|embed_audio)\.(\w+)\.weight$", name)
        if hard and self.hard_tokens is not None and hard[2] != "soft_embedding_norm":
            return f"hard_tokens.{hard[1]}.{hard[2]}.weight", None
        found = re.match(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", name)
        if found and int(found[1]) < len(self.sources) and self.sources[int(found[1])] is not None:
            return None
        return super().map_name(name)


def _layer_types(cfg: ModelConfig) -> list[str]:
    """``layer_types``, else transformers' default: every fifth layer full."""
    types = cfg.get("layer_types")
    if types is None:
        return [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(cfg.num_layers)]
    return checked_kinds(types, cfg.num_layers, (SLIDING, FULL), "Gemma 3n ")


def _altup_inputs(cfg: ModelConfig) -> int:
    n, active = cfg.get("altup_num_inputs", 4), cfg.get("altup_active_idx", 0)
    if not isinstance(n, int) or n < 1 or not 0 <= active < n:
        raise UnsupportedModelError(
            f"altup_active_idx {active} is not one of the altup_num_inputs {n} copies"
        )
    return n


def _per_layer(cfg: ModelConfig, key: str, default):
    """``key`` as one value per layer (a single value for all), refused by name where a list
    is not one per layer."""
    value = cfg.get(key, default)
    if value is None or not isinstance(value, (list, tuple)):
        return value if value is None else [value] * cfg.num_layers
    if len(value) != cfg.num_layers:
        raise UnsupportedModelError(f"{key} lists {len(value)} values for {cfg.num_layers} layers")
    return list(value)
