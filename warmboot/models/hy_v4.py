"""HY-V4 (Tencent Hunyuan, ``HYV4ForCausalLM``): GLM-5's sparse indexed attention (indexing
``full`` layers, ``shared`` layers reusing the last full layer's selection,
``models.deepseek_v32``) under hyper-connections, with

- ``hc_mult`` residual streams (the embedding copied into each): before each sublayer a
  ``HyperConnection`` mixes them into the sublayer's input (weights
  ``sigmoid(scale_pre * mix + base) + hc_eps`` of a linear map of all streams times their
  inverse RMS) and weighs the sublayer's output into each stream
  (``hc_magnitude * sigmoid(scale_post * mix + base) + hc_eps``), in float32; the decoder
  layers pass the streams as one ``(N, hc_mult * hidden)`` row; a ``HyperHead`` mixes them
  into one before the final norm;
- the latent attention's rope on half-split pairs, a learned sink logit per head, and each
  head's output times ``sigmoid(gate_proj(x))`` before ``o_proj``;
- the indexer's rope on the last ``qk_rope_head_dim`` dims of its queries and key, its key
  norm in float32 with ``rms_norm_eps``, its weights times the softmax scale (the same scores
  as V3.2's: the ReLU commutes with a positive scale);
- routed experts as SwiGLU with the gate clamped above and the up projection both ways at
  ``swiglu_limit`` (V3's sigmoid routing with groups and a correction bias; shared experts);
- ``indexer_types``, else full at layer 0 and every fourth from layer 1; ``mlp_layer_types``,
  else the first layer dense.

The hyper-connections run in float32 from their parameters as loaded; a bf16 engine holds
them, the indexer's ``weights_proj`` and the LM head in bf16 (transformers keeps them float32).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.kernels.step_ops import StepContext
from warmboot.models.base import RunLayer
from warmboot.models.deepseek_v32 import GlmMoeDsaForCausalLM
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import run_layers
from warmboot.models.layers.indexer import IndexedMLAttention, Indexer
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import SparseMoE

FULL, SHARED = "full", "shared"


def _inverse_rms(flat: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One sublayer's stream mixing: ``fn`` (2m, m * hidden), ``base`` (2m), ``scale`` (2):
    (N, m, hidden) streams -> (post weights (N, m) float32, the sublayer input (N, hidden))."""

    def __init__(self, streams: int, hidden: int, eps: float, hc_eps: float, magnitude: float):
        super().__init__()
        self.streams, self.eps, self.hc_eps, self.magnitude = streams, eps, hc_eps, magnitude
        self.fn = nn.Parameter(torch.empty(2 * streams, streams * hidden))
        self.base = nn.Parameter(torch.empty(2 * streams))
        self.scale = nn.Parameter(torch.empty(2))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = streams.flatten(1).float()
        mixes = F.linear(flat, self.fn.float()) * _inverse_rms(flat, self.eps)
        pre_logits, post_logits = mixes.split(self.streams, dim=-1)
        pre_base, post_base = self.base.float().split(self.streams)
        pre_scale, post_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_logits * pre_scale + pre_base) + self.hc_eps
        post = self.magnitude * torch.sigmoid(post_logits * post_scale + post_base) + self.hc_eps
        mixed = (pre.unsqueeze(-1) * streams).sum(dim=1)
        return post, mixed.to(streams.dtype)


class HyperHead(nn.Module):
    """The streams' final mix: ``hc_fn`` (m, m * hidden), ``hc_base`` (m), ``hc_scale`` (1)."""

    def __init__(self, streams: int, hidden: int, eps: float, hc_eps: float):
        super().__init__()
        self.streams, self.eps, self.hc_eps = streams, eps, hc_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden))
        self.hc_base = nn.Parameter(torch.empty(streams))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(1).float()
        mixes = F.linear(flat, self.hc_fn.float()) * _inverse_rms(flat, self.eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each between a ``HyperConnection``'s mix and its
    weighted return into the streams; ``(N, m * hidden)`` rows in and out."""

    def __init__(self, self_attn, mlp, input_layernorm, post_attention_layernorm, attn_hc, ffn_hc):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc

    def forward(self, row: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        streams = row.unflatten(1, (self.attn_hc.streams, -1))
        post, x = self.attn_hc(streams)
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        streams = _merge(streams, post, h)
        post, x = self.ffn_hc(streams)
        streams = _merge(streams, post, self.mlp(self.post_attention_layernorm(x)))
        return streams.flatten(1)


def _merge(streams: torch.Tensor, post: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each stream plus the sublayer's output times its post weight, in float32."""
    return (post.unsqueeze(-1) * h.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class GatedSinkMLA(IndexedMLAttention):
    """Indexed MLA with a sink logit per head (``sinks``) and each head's output times
    ``sigmoid(linear_gate(x))`` (``v_head_dim`` gates a head; transformers' ``gate_proj``)."""

    def __init__(self, hidden: int, num_heads: int, **kwargs):
        super().__init__(hidden, num_heads, **kwargs)
        self.linear_gate = Linear(hidden, num_heads * self.v_dim)
        self.sinks = nn.Parameter(torch.empty(num_heads))

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        gate = self.linear_gate(x).view(o.shape)
        return super().project_out(x, o * torch.sigmoid(gate))


def clamped_silu(limit: float):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` over a (rows, 2I) gate/up."""

    def act_and_mul(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    return act_and_mul


class HYV4ForCausalLM(GlmMoeDsaForCausalLM):
    defaults = dict(first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True)
    renames = (
        (r"\.hc_pre\.hc_", ".hc_"),
        (r"^model\.", ""),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.learnable_sink_param$", ".sinks"),
        (r"\.self_attn\.gate_proj\.", ".self_attn.linear_gate."),
        (r"(?<!self_attn)\.linear_gate\.", ".gate_proj."),
        (r"\.hc_(attn|mlp)_layer\.hc_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.mlp_hc\.", ".ffn_hc."),
        (r"\.hc_head_(fn|base|scale)$", r".hc_\1"),
    )
    """The released checkpoints' names (``linear_gate`` for every ``gate_proj``, hc parameters
    under ``hc_pre``) and transformers' to ours (its names, but the attention's gate's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.streams = cfg.get("hc_mult", 4)
        self.hc_head = HyperHead(self.streams, cfg.hidden_size, eps, cfg.get("hc_eps", 1e-6))

    @classmethod
    def check_indexers(cls, cfg: ModelConfig, refuse) -> None:
        kinds = hy_indexer_types(cfg)
        if len(kinds) != cfg.num_layers or set(kinds) - {FULL, SHARED}:
            refuse(f"indexer_types {kinds!r} (full or shared, one per layer)")
        if kinds and kinds[0] != FULL:
            refuse("indexer_types: the first layer shares a selection no layer made")
        if not isinstance(cfg.get("hc_mult", 4), int) or cfg.get("hc_mult", 4) < 1:
            refuse(f"hc_mult {cfg.get('hc_mult')!r} (a positive number of streams)")
        limit = cfg.get("swiglu_limit", 10.0)
        if limit is None or limit <= 0:
            refuse(f"swiglu_limit {limit!r} (transformers clamps to it; its docs say <= 0 is off)")

    def runs_indexer(self, index: int) -> bool:
        return hy_indexer_types(self.cfg)[index] == FULL

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        size, eps = cfg.hidden_size, cfg.get("rms_norm_eps", 1e-5)
        hc_eps, magnitude = cfg.get("hc_eps", 1e-6), cfg.get("hc_magnitude", 2.0)
        streams = cfg.get("hc_mult", 4)
        return HyperDecoderLayer(
            self.make_attention(index),
            self.make_mlp(index),
            self.make_norm(size),
            self.make_norm(size),
            HyperConnection(streams, size, eps, hc_eps, magnitude),
            HyperConnection(streams, size, eps, hc_eps, magnitude),
        )

    def make_attention(self, index: int) -> nn.Module:
        cfg = self.cfg
        nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        half_split = self.latent_rope(self.rope_spec(interleaved=False), rope)
        indexer = None
        if self.runs_indexer(index):
            indexer = Indexer(
                cfg.hidden_size,
                cfg.get("q_lora_rank"),
                cfg.get("index_n_heads"),
                cfg.get("index_head_dim"),
                half_split,
                rope_last=True,
                norm_eps=cfg.get("rms_norm_eps", 1e-5),
                norm_upcast=True,
            )
        return GatedSinkMLA(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg.get("kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=cfg.get("v_head_dim"),
            rope=half_split,
            spec=AttentionSpec(scale=self.softmax_scale(nope + rope)),
            bias=bool(cfg.get("attention_bias", False)),
            indexer=indexer,
            topk=cfg.get("index_topk"),
        )

    def make_mlp(self, index: int) -> nn.Module:
        mlp = super().make_mlp(index)
        if isinstance(mlp, SparseMoE):
            mlp.experts.act_and_mul = clamped_silu(float(self.cfg.get("swiglu_limit", 10.0)))
        return mlp

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        run_layer: RunLayer | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        row = x.repeat(1, self.streams)  # NOTE: the streams side by side, each the embedding
        row = run_layers(self.layers, row, positions, step, run_layer)
        return self.norm(self.hc_head(row.unflatten(1, (self.streams, -1))))

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        if re.match(r"^model\.mtp_layers\.", name):
            return None  # NOTE: multi-token-prediction layers, unused in decoding
        return super().map_name(name)


def hy_indexer_types(cfg: ModelConfig) -> list[str]:
    """``indexer_types``, else transformers' default: full at layer 0 and every fourth
    layer from layer 1, shared between."""
    kinds = cfg.get("indexer_types")
    if kinds is not None:
        return list(kinds)
    return [FULL if i == 0 or (i - 1) % 4 == 0 else SHARED for i in range(cfg.num_layers)]
