"""DeepSeek-V4 (``deepseek_v4``): per layer ``layer_types``' attention
(``layers.compressed``: a sliding window with sinks, plus compressed sparse attention or
heavily compressed attention at ``compress_rates``) and an MoE, under hyper-connections:

- ``hc_mult`` residual streams (the embedding copied into each), carried as one
  ``(N, hc_mult * hidden)`` row; before each sublayer a ``SinkhornHyperConnection`` mixes
  them into its input and gives post weights and a Sinkhorn-normalised ``comb`` matrix; the
  streams become ``post * out + comb^T @ streams``; ``HyperHead`` (HY-V4's) mixes them into
  one before the final norm;
- ``mlp_layer_types``: ``hash_moe`` layers take their experts from ``tid2eid[token id]``
  (the token id rides in the row's last three columns, one byte each: exact in bf16),
  ``moe`` layers the top-k of the scores plus a correction bias; scores ``scoring_func``
  (``sqrtsoftplus``), weights renormalised then times ``routed_scaling_factor``; experts and
  the shared expert SwiGLU clamped at ``swiglu_limit``;
- ropes from ``rope_parameters``' ``main`` (window-only layers) and ``compress`` (the
  compressed layers, their entries and indexer), interleaved on the last dims.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import KVLayout
from warmboot.kernels.step_ops import StepContext
from warmboot.models.base import CausalLM, RunLayer
from warmboot.models.deepseek import _refuser
from warmboot.models.hy_v4 import HyperHead, clamped_silu
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.compressed import CompressedAttention, LightningIndexer
from warmboot.models.layers.decoder import run_layers
from warmboot.models.layers.moe import FusedExperts
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "softmax": lambda x: x.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}
ID_COLUMNS = 3


class SinkhornHyperConnection(nn.Module):
    """``fn`` ((2 + m) m, m * hidden), ``base``, ``scale`` (3): streams (N, m, hidden) ->
    (post (N, m), comb (N, m, m), the sublayer input (N, hidden))."""

    def __init__(self, streams: int, hidden: int, eps: float, hc_eps: float, iters: int):
        super().__init__()
        self.m, self.eps, self.hc_eps, self.iters = streams, eps, hc_eps, iters
        self.fn = nn.Parameter(torch.empty((2 + streams) * streams, streams * hidden))
        self.base = nn.Parameter(torch.empty((2 + streams) * streams))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor):
        m = self.m
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([m, m, m * m])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = comb_w.view(-1, m, m) * s_comb + comb_b.view(m, m)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        mixed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, mixed


def _merge(streams, post, comb, out):
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class ClampedMLP(GatedMLP):
    """The shared expert: SwiGLU with the gate clamped above and up both ways."""

    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__(hidden, intermediate, "silu")
        self.act_and_mul = clamped_silu(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class V4Router(nn.Module):
    """``weight`` (E, hidden); ``tid2eid`` (vocab, k): hash routing, else ``bias`` (E): the
    correction bias of the top-k choice. -> (weights (N, k), ids (N, k))."""

    def __init__(self, hidden, experts, top_k, vocab, hashed, scoring, scale):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.top_k, self.score, self.scale = top_k, SCORES[scoring], scale
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(vocab, top_k, dtype=torch.long), False)
        else:
            self.bias = nn.Parameter(torch.empty(experts))
        self.hashed = hashed

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor):
        scores = self.score(F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[token_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(x.dtype), ids


class V4MoE(nn.Module):
    def __init__(self, gate: V4Router, experts: FusedExperts, shared_experts: nn.Module):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    """Rows ``(N, m * hidden + 3)``: the streams, then the token id's bytes."""

    def __init__(self, attn, ffn, attn_norm, ffn_norm, hc_attn, hc_ffn):
        super().__init__()
        self.attn, self.ffn, self.attn_norm, self.ffn_norm = attn, ffn, attn_norm, ffn_norm
        self.attn_hc, self.ffn_hc = hc_attn, hc_ffn

    def forward(self, row: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        tail = row[:, -ID_COLUMNS:]
        streams = row[:, :-ID_COLUMNS].unflatten(1, (self.attn_hc.m, -1))
        post, comb, x = self.attn_hc(streams)
        streams = _merge(streams, post, comb, self.attn(self.attn_norm(x), positions, attend))
        post, comb, x = self.ffn_hc(streams)
        digits = tail.round().long()
        token_ids = (digits[:, 0] << 16) | (digits[:, 1] << 8) | digits[:, 2]
        streams = _merge(streams, post, comb, self.ffn(self.ffn_norm(x), token_ids))
        return torch.cat([streams.flatten(1), tail], dim=1)


class DeepseekV4ForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^embed\.", "embed_tokens."),
        (r"^head\.", "lm_head."),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.wo_a\.weight$", ".wo_a"),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    )
    stacked = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
    expert_projections = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
    expert_projections |= {"w2": ("down_proj", 0)}
    ignored = (r"(^|\.)mtp\.",)
    integer_tensors = True
    """The hash layers' ``tid2eid`` tables are int64 (the loader reads integer tensors)."""

    def __init__(self, cfg: ModelConfig):
        self.check(cfg)
        super().__init__(cfg)
        self.streams = cfg.get("hc_mult", 4)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.hc_head = HyperHead(self.streams, cfg.hidden_size, eps, cfg.get("hc_eps", 1e-6))

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """Refuse what is not served exactly, by name."""
        refuse = _refuser(cfg.architecture)
        n = cfg.num_layers
        kinds, mlp = cfg.get("layer_types"), cfg.get("mlp_layer_types")
        if not kinds or len(kinds) != n or set(kinds) - {SLIDING, CSA, HCA}:
            refuse(f"layer_types {kinds!r} (one of {SLIDING}, {CSA}, {HCA} per layer)")
        if not mlp or len(mlp) != n or set(mlp) - {"hash_moe", "moe"}:
            refuse(f"mlp_layer_types {mlp!r} (hash_moe or moe per layer)")
        rates = cfg.get("compress_rates") or {}
        for kind in {CSA, HCA} & set(kinds):
            if not isinstance(rates.get(kind), int) or rates[kind] < 1:
                refuse(f"compress_rates[{kind!r}] {rates.get(kind)!r} (a positive int)")
        for name in ("q_lora_rank", "o_groups", "o_lora_rank", "head_dim", "sliding_window"):
            if not isinstance(cfg.get(name), int) or cfg.get(name) < 1:
                refuse(f"{name} {cfg.get(name)!r} (a positive int)")
        if CSA in kinds:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if not isinstance(cfg.get(name), int) or cfg.get(name) < 1:
                    refuse(f"{name} {cfg.get(name)!r} (a positive int)")
            if rope_dim(cfg) > cfg.get("index_head_dim"):
                refuse("a rope wider than index_head_dim (the indexer rotates that many dims)")
        if (cfg.num_heads * cfg.get("head_dim")) % cfg.get("o_groups"):
            refuse(f"o_groups {cfg.get('o_groups')} (must divide the heads' width)")
        if rope_dim(cfg) % 2 or not 0 < rope_dim(cfg) <= cfg.get("head_dim"):
            refuse(f"partial_rotary_factor {cfg.get('partial_rotary_factor')!r}")
        if cfg.get("scoring_func", "sqrtsoftplus") not in SCORES:
            refuse(f"scoring_func {cfg.get('scoring_func')!r} (one of {sorted(SCORES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
        if not isinstance(cfg.get("hc_mult", 4), int) or cfg.get("hc_mult", 4) < 1:
            refuse(f"hc_mult {cfg.get('hc_mult')!r} (a positive number of streams)")
        if cfg.get("swiglu_limit") is None or cfg.get("swiglu_limit") <= 0:
            refuse(f"swiglu_limit {cfg.get('swiglu_limit')!r} (transformers clamps at it)")
        if cfg.get("quantization_config"):
            refuse("quantization_config (DeepSeek-V4's FP8 / FP4 checkpoints are not checked)")
        if cfg.vocab_size >= 1 << (8 * ID_COLUMNS):
            refuse(f"vocab_size {cfg.vocab_size} (token ids ride in {ID_COLUMNS} bytes)")
        for label in ("main", "compress"):
            spec = _rope(cfg, label)
            if spec.length_dependent:
                refuse(f"rope_parameters[{label!r}] {spec.rope_type!r} (length-dependent)")

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        size, eps = cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6)
        m, hc_eps = cfg.get("hc_mult", 4), cfg.get("hc_eps", 1e-6)
        iters = cfg.get("hc_sinkhorn_iters", 20)
        return V4DecoderLayer(
            self.make_attention(index),
            self.make_moe(index),
            self.make_norm(size),
            self.make_norm(size),
            SinkhornHyperConnection(m, size, eps, hc_eps, iters),
            SinkhornHyperConnection(m, size, eps, hc_eps, iters),
        )

    def make_attention(self, index: int) -> CompressedAttention:
        cfg = self.cfg
        kind, eps = cfg.get("layer_types")[index], cfg.get("rms_norm_eps", 1e-6)
        rate = 0 if kind == SLIDING else cfg.get("compress_rates")[kind]
        indexer = None
        if kind == CSA:
            indexer = LightningIndexer(
                cfg.hidden_size,
                cfg.get("q_lora_rank"),
                cfg.get("index_n_heads"),
                cfg.get("index_head_dim"),
                rate,
                eps,
            )
        return CompressedAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.get("head_dim"),
            q_lora_rank=cfg.get("q_lora_rank"),
            o_groups=cfg.get("o_groups"),
            o_lora_rank=cfg.get("o_lora_rank"),
            rope=self.rope("main" if kind == SLIDING else "compress"),
            window=cfg.get("sliding_window"),
            rate=rate,
            indexer=indexer,
            topk=cfg.get("index_topk", 1),
            eps=eps,
        )

    def rope(self, label: str) -> RotaryEmbedding:
        """One interleaved rope of the rotary dims per label, shared by the layers."""
        ropes = self.__dict__.setdefault("_ropes", {})
        if label not in ropes:
            ropes[label] = RotaryEmbedding(_rope(self.cfg, label), rope_dim(self.cfg))
        return ropes[label]

    def make_moe(self, index: int) -> V4MoE:
        cfg = self.cfg
        size, inter = cfg.hidden_size, cfg.get("moe_intermediate_size")
        experts, k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
        limit = float(cfg.get("swiglu_limit"))
        hashed = cfg.get("mlp_layer_types")[index] == "hash_moe"
        scoring, scale = cfg.get("scoring_func", "sqrtsoftplus"), cfg.get("routed_scaling_factor")
        gate = V4Router(size, experts, k, cfg.vocab_size, hashed, scoring, scale or 1.0)
        fused = FusedExperts(experts, size, inter, act_and_mul=clamped_silu(limit))
        return V4MoE(gate, fused, ClampedMLP(size, inter, limit))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        run_layer: RunLayer | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        shifts = torch.tensor([16, 8, 0], device=input_ids.device)
        digits = ((input_ids.unsqueeze(1) >> shifts) & 255).to(x.dtype)
        row = torch.cat([x.repeat(1, self.streams), digits], dim=1)
        row = run_layers(self.layers, row, positions, step, run_layer)
        streams = row[:, :-ID_COLUMNS].unflatten(1, (self.streams, -1))
        return self.norm(self.hc_head(streams))

    def kv_layout(self) -> KVLayout:
        """One K = V head per token and layer, beside it the compressor rows (the widest
        layer's; the others use a prefix)."""
        width = max(la.attn.side_width() for la in self.layers)
        layout = KVLayout(1, 1, self.cfg.get("head_dim"), index_dim=width)
        return dataclasses.replace(self.with_states(layout), index_dim=width)


def rope_dim(cfg: ModelConfig) -> int:
    """The rotated dims of a head (transformers' ``qk_rope_head_dim``)."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        return cfg.get("qk_rope_head_dim", 64)
    return int(cfg.get("head_dim") * factor)


def _rope(cfg: ModelConfig, label: str) -> RopeSpec:
    """``rope_parameters[label]`` (the config's nesting) as an interleaved rope over the
    rotary dims only."""
    params = dict((cfg.get("rope_parameters") or {}).get(label) or {})
    theta = cfg.get("rope_theta" if label == "main" else "compress_rope_theta", 10000.0)
    params.pop("partial_rotary_factor", None)
    return RopeSpec.parse(
        params,
        theta=theta,
        max_position_embeddings=cfg.max_position_embeddings,
        interleaved=True,
    )
