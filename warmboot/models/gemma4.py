"""Gemma 4 (text, ``gemma4_text``): Gemma 3's sandwich layers of sliding and full attention,
with q, k and v normed per head (v without a scale), scores unscaled, RMSNorms scaled by ``w``
in float32, each layer's output times its ``layer_scalar``, and soft-capped logits; also

- a head size and K/V head count per layer (``per_layer_config``, or ``global_head_dim`` and
  ``num_global_key_value_heads`` on the full layers) and a rope per layer type (``default``,
  or ``proportional``: the whole head rotates, the frequencies past its share zero);
- ``attention_k_eq_v``: a full layer's V is its K projection (before K's norm and rope);
- per-layer inputs (``layers.per_layer``), added after the MLP through each layer's gate;
- KV sharing: the last ``num_kv_shared_layers`` layers read the K/V of the last earlier layer
  of their type (``AttentionSpec.kv_source``) and keep none; ``use_double_wide_mlp``: their
  MLPs twice as wide;
- ``enable_moe_block``: experts beside the dense MLP, routed from the residual; the two
  branches post-normed and summed.

The paged cache has one K/V head count and width for all layers, so it is laid out for the
widest (as MiMo-V2-Flash's): fewer K/V heads are stored repeated (a query head still reads its
own), a narrower head zero-padded (q too: scores and kept output dims unchanged): exact, at
the cost of cache beyond transformers' on the narrower layers."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.kernels.step_ops import StepContext
from warmboot.models.base import CausalLM, RunLayer
from warmboot.models.gemma import FULL, SLIDING, _rounded
from warmboot.models.gemma4_settings import (
    HeadShape,
    check_servable,
    head_shapes,
    kv_sources,
    layer_types,
    moe_sizes,
    rope_spec,
)
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import run_layers
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router
from warmboot.models.layers.per_layer import (
    PER_LAYER_RENAMES,
    PerLayerEmbedding,
    PerLayerInput,
    per_layer_rows,
    split_row,
)
from warmboot.models.layers.rope import RotaryEmbedding
from warmboot.models.layers.towers import placeholders, placeholders_to_pad


class Gemma4RMSNorm(nn.Module):
    """``x * (mean(x^2) + eps) ** -0.5`` times ``weight`` (none without ``scale``), in float32."""

    def __init__(self, size: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf if self.weight is None else xf * self.weight.float()).to(x.dtype)


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """``proportional`` rope: the whole head rotates; its first ``proportion`` share of
    frequencies over the whole head's exponents (divided by ``factor``), the rest zero."""

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        d, spec = self.head_dim, self.spec
        angles = int(spec.get("proportion") * d // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d
        inv_freq = F.pad(1.0 / (spec.theta**exponents), (0, d // 2 - angles))
        inv_freq = inv_freq / spec.get("factor", 1.0)
        self.rows, self.dtype = max_positions, dtype
        cos, sin = self._cos_sin(torch.arange(max_positions).float()[:, None] * inv_freq, 1.0)
        self.cos, self.sin = cos.to(device), sin.to(device)


class Gemma4Attention(nn.Module):
    """q (and, unless the layer reads another's K/V, k and v) projected, normed per head and
    rotated; K/V repeated and q/K/V padded to the cache's shape; a layer reading another's
    K/V hands the step dummies (``StepContext.attend`` replaces them with the source's)."""

    def __init__(self, hidden, shape: HeadShape, *, rope, spec, k_eq_v, eps, bias):
        super().__init__()
        self.shape, self.kv_parts = shape, 1 if k_eq_v else 2
        self.shared = spec.kv_source is not None
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        shards = [q] if self.shared else [q, kv] if k_eq_v else [q, kv, kv]
        self.qkv_proj = Linear(hidden, shards, bias=bias)
        self.o_proj = Linear(q, hidden, bias=bias)
        self.q_norm = Gemma4RMSNorm(shape.head_dim, eps)
        if not self.shared:
            self.k_norm = Gemma4RMSNorm(shape.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(shape.head_dim, eps, scale=False)
        self.rope, self.spec = rope, spec

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        s, n = self.shape, x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : s.heads * s.head_dim].reshape(n, s.heads, s.head_dim))
        if self.shared:  # NOTE: K/V dummies, a view of q (``StepContext.attend`` replaces them)
            q = self._padded(self.rope(positions, q, q[:, :0])[0])
            k = v = q[:, : s.cache_heads]
        else:
            kv = qkv[:, s.heads * s.head_dim :].reshape(n, self.kv_parts, s.kv_heads, s.head_dim)
            k, v = kv[:, 0], kv[:, -1]  # NOTE: one part with k_eq_v: V is K's projection
            q, k = self.rope(positions, q, self.k_norm(k))
            q, k, v = self._padded(q), self._cached(k), self._cached(self.v_norm(v))
        o = attend(q, k, v)[..., : s.head_dim]
        return self.o_proj(o.reshape(n, s.heads * s.head_dim))

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.shape.cache_dim - self.shape.head_dim
        return F.pad(x, (0, pad)) if pad else x

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        """(N, kv_heads, D) -> (N, cache_heads, cache_dim): heads repeated, dims padded."""
        repeat = self.shape.cache_heads // self.shape.kv_heads
        return self._padded(x.repeat_interleave(repeat, dim=1) if repeat > 1 else x)


class Gemma4Router(Router):
    """Routes from ``norm(x) * input_scale * hidden ** -0.5`` (an unscaled norm): softmax,
    top-k renormalised, each weight times its expert's ``per_expert_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__(hidden, num_experts, top_k, renormalize=True)
        self.norm = Gemma4RMSNorm(hidden, eps, scale=False)
        self.input_scale = nn.Parameter(torch.empty(hidden))
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = Linear.forward(self, self.norm(x) * self.input_scale * self.in_features**-0.5)
        weights, ids = self.select(logits)  # NOTE: float32, scaled before the cast (as HF)
        return (weights * self.per_expert_scale[ids]).to(x.dtype), ids


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP (with the experts beside it), the per-layer input's
    branch, all times ``layer_scalar``. Its row: the hidden state, then its per-layer input."""

    def __init__(self, attn, mlp, make_norm, per_layer, moe):
        super().__init__()
        self.self_attn, self.mlp, self.per_layer = attn, mlp, per_layer
        self.width = 0 if per_layer is None else per_layer.per_layer_input_gate.out_features
        self.input_layernorm, self.post_attention_layernorm = make_norm(), make_norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = make_norm(), make_norm()
        self.router, self.experts = moe if moe else (None, None)
        if moe:
            self.pre_feedforward_layernorm_2 = make_norm()
            self.post_feedforward_layernorm_1 = make_norm()
            self.post_feedforward_layernorm_2 = make_norm()
        self.layer_scalar = nn.Parameter(torch.empty(1))

    def forward(self, row: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x, per_layer_input = split_row(row, self.width)
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            x = x + self.per_layer(x, per_layer_input)
        return x * self.layer_scalar


class Gemma4ForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        *PER_LAYER_RENAMES,
        (r"\.router\.proj\.", ".router."),
        (r"\.router\.scale$", ".router.input_scale"),  # NOTE: ``Router.scale`` is the routing's
    )
    tied_by_default = True

    def __init__(self, cfg: ModelConfig):
        check_servable(cfg)
        kv_heads = cfg.get("num_key_value_heads", 4)
        cfg = dataclasses.replace(cfg, head_dim=cfg.get("head_dim", 256), num_kv_heads=kv_heads)
        self.types = layer_types(cfg)
        self.sources = kv_sources(cfg, self.types)
        self.shapes = head_shapes(cfg, self.types, self.sources)
        self.act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        self.width = cfg.get("hidden_size_per_layer_input", 256) or 0
        super().__init__(cfg)
        self.final_softcap, self.per_layer_embedding = cfg.get("final_logit_softcapping"), None
        self.placeholders = placeholders(cfg)  # NOTE: a multimodal release's (``layers.towers``)
        if self.width:
            vocab = cfg.get("vocab_size_per_layer_input", 262_144)
            self.per_layer_embedding = PerLayerEmbedding(
                vocab, cfg.num_layers, self.width, cfg.hidden_size, self.make_norm, True
            )

    def make_norm(self, size: int) -> nn.Module:
        return Gemma4RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, eps = cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6)
        wide = cfg.get("use_double_wide_mlp", False) and self.sources[index] is not None
        mlp = GatedMLP(hidden, cfg.get("intermediate_size", 9216) * (2 if wide else 1), self.act)
        per_layer = None
        if self.width:
            per_layer = PerLayerInput(hidden, self.width, self.act, self.make_norm(hidden))
        moe = None
        if cfg.get("enable_moe_block", False):
            experts, top_k, size = moe_sizes(cfg)
            router = Gemma4Router(hidden, experts, top_k, eps)
            moe = (router, FusedExperts(experts, hidden, size, self.act))
        norm = lambda: self.make_norm(hidden)  # noqa: E731
        return Gemma4DecoderLayer(self.attention(index), mlp, norm, per_layer, moe)

    def attention(self, index: int, **kwargs) -> nn.Module:
        cfg, kind = self.cfg, self.types[index]
        window = cfg.get("sliding_window", 512) if kind == SLIDING else None
        spec = AttentionSpec(1.0, window, kv_source=self.sources[index])
        shape = self.shapes[index]
        return Gemma4Attention(
            cfg.hidden_size,
            shape,
            rope=self.type_rope(kind, shape.head_dim),
            spec=spec,
            k_eq_v=bool(cfg.get("attention_k_eq_v", False)) and kind == FULL,
            eps=cfg.get("rms_norm_eps", 1e-6),
            bias=bool(cfg.get("attention_bias", False)),
        )

    def type_rope(self, kind: str, head_dim: int) -> RotaryEmbedding:
        """One rotary embedding per layer type (its head size is the type's)."""
        ropes = self.__dict__.setdefault("_type_ropes", {})
        if kind not in ropes:
            spec = rope_spec(self.cfg, kind)
            cls = RotaryEmbedding
            if spec.rope_type == "proportional":
                cls = ProportionalRotaryEmbedding
            ropes[kind] = cls(spec, head_dim)
        return ropes[kind]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * _rounded(self.cfg.hidden_size**0.5, x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        run_layer: RunLayer | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids := placeholders_to_pad(input_ids, self.placeholders))
        per_layer = None if (ple := self.per_layer_embedding) is None else ple(input_ids, x)
        return self.norm(
            run_layers(self.layers, x, positions, step, run_layer, per_layer_rows(per_layer))
        )

    def kv_layout(self) -> KVLayout:
        shape = self.shapes[0]
        return self.with_states(KVLayout(2, shape.cache_heads, shape.cache_dim))

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """As the base's; a shared layer's K/V projections and norms (real checkpoints keep
        them, transformers does not read them) ignored."""
        found = re.match(r"^model\.layers\.(\d+)\.self_attn\.[kv]_(proj|norm)\.", name)
        if found and dict(enumerate(self.sources)).get(int(found[1])) is not None:
            return None
        return super().map_name(name)
