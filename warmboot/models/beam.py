"""Beam (Reflection AI, ``BeamForCausalLM``): sandwich norms (a norm before and after each
sublayer) whose residual adds are depth-scaled (the k-th add of the stack, k = 2, 3, ...:
``h / sqrt(k) + x * sqrt((k - 1) / k)``); Qwen3's per-head q/k RMSNorm; an output gate
``sigmoid(gate_proj(x) + gate_bias[head])`` on every head; windows and rope on the
``sliding_attention`` layers (``rope_parameters`` per layer type), NoPE on the full layers
with scalable-softmax queries (times ``(1 + (position + 1) / 2048) ** 0.1``, in float32);
dense layers per ``mlp_layer_types``, else DeepSeek-V3's routing (sigmoid in float32,
``e_score_correction_bias``, groups scored by their best two, renormalised) over experts
without shared ones, the sum times ``routed_scaling_factor``; logits soft-capped."""

from __future__ import annotations

import math

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend, Attention
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.rope import RopeSpec


class BeamAttention(Attention):
    """Attention with a biased per-element output gate; NoPE layers scale their queries."""

    def __init__(self, *args, ssmax: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_gate = Linear(args[0], self.q_size)
        self.gate_bias = nn.Parameter(torch.empty(self.num_heads))
        self.ssmax = ssmax

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(n, self.num_heads, d), k.reshape(n, self.num_kv_heads, d)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(positions, q, k)
        if self.ssmax:
            scale = torch.exp(0.1 * torch.log1p((positions.float() + 1) / 2048))
            q = (q.float() * scale[:, None, None]).to(q.dtype)
        o = attend(q, k, v.reshape(n, self.num_kv_heads, d)).reshape(n, self.num_heads, d)
        gate = self.out_gate(x).reshape(n, self.num_heads, d) + self.gate_bias[:, None]
        return self.o_proj((o * torch.sigmoid(gate)).reshape(n, self.q_size))


class ScaledMoE(SparseMoE):
    """The routed experts' sum times ``routed_scaling_factor``."""

    def __init__(self, gate: Router, experts: FusedExperts, scale: float):
        super().__init__(gate, experts)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class BeamDecoderLayer(nn.Module):
    def __init__(self, index: int, self_attn: nn.Module, mlp: nn.Module, norms: list[nn.Module]):
        super().__init__()
        self.self_attn, self.mlp, self.index = self_attn, mlp, index
        self.input_layernorm, self.post_attention_layernorm = norms[:2]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norms[2:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, attend)
        )
        x = _scaled_add(h, x, 2 * (self.index + 1))
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return _scaled_add(h, x, 2 * (self.index + 1) + 1)


def _scaled_add(h: torch.Tensor, x: torch.Tensor, k: int) -> torch.Tensor:
    return h * (1.0 / math.sqrt(k)) + x * math.sqrt((k - 1) / k)


class BeamForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.self_attn\.gate_proj\.", ".self_attn.out_gate."),
    )

    def __init__(self, cfg: ModelConfig):
        n = cfg.num_layers
        full = [(i + 1) % 6 == 0 or i == n - 1 for i in range(n)]
        default_types = ["full_attention" if f else "sliding_attention" for f in full]
        self.layer_types = cfg.get("layer_types") or default_types
        self.mlp_types = cfg.get("mlp_layer_types") or ["dense"] * 3 + ["sparse"] * (n - 3)
        experts, groups = cfg.get("num_experts"), cfg.get("n_group") or 1
        if experts % groups or experts // groups < 2:
            raise UnsupportedModelError(f"{cfg.architecture}: n_group {groups}, {experts} experts")
        super().__init__(cfg)
        self.final_softcap = cfg.get("final_logit_softcapping")

    def make_layer(self, index: int) -> nn.Module:
        norms = [self.make_norm(self.cfg.hidden_size) for _ in range(4)]
        return BeamDecoderLayer(index, self.make_attention(index), self.make_mlp(index), norms)

    def make_attention(self, index: int) -> nn.Module:
        cfg, d = self.cfg, self.cfg.head_dim
        kind = self.layer_types[index]
        params = (cfg.get("rope_parameters") or {}).get(kind)
        rope = None
        if params is not None:
            spec = RopeSpec.parse(params, max_position_embeddings=cfg.max_position_embeddings)
            rope = self.shared_rope(spec)
        window = cfg.get("sliding_window") if kind == "sliding_attention" else None
        return BeamAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            rope=rope,
            spec=AttentionSpec(scale=d**-0.5, sliding_window=window),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            q_norm=self.make_norm(d),
            k_norm=self.make_norm(d),
            ssmax=rope is None,
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg, hidden = self.cfg, self.cfg.hidden_size
        act = cfg.get("hidden_act", "silu")
        if self.mlp_types[index] == "dense":
            return GatedMLP(hidden, cfg.get("intermediate_size"), act)
        experts = cfg.get("num_experts")
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            correction_bias=True,
            groups=cfg.get("n_group"),
            topk_groups=cfg.get("topk_group"),
            group_score="top2",
            float32=True,
        )
        size = cfg.get("moe_intermediate_size")
        scale = float(cfg.get("routed_scaling_factor", 2.5))
        return ScaledMoE(router, FusedExperts(experts, hidden, size, act), scale)
