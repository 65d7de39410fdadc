"""A.X-K2 (SK Telecom, ``AXK2ForCausalLM``): DeepSeek-V3.2 (latent attention with DeepSeek
Sparse Attention's indexer, ``models.deepseek_v32``) with

- a fused query/gate projection: ``q_b_proj`` reads ``[q_a_layernorm(q_a_proj(x)),
  q_a_proj(x)]`` and gives per head the query (nope + rope) and a gate (``v_head_dim``) on
  the attention output, ``out * sigmoid(gate)`` in float32, before ``o_proj``;
- gated norms (``GatedRMSNorm``): ``y = RMSNorm(x); y * sigmoid(W_up(silu(W_down(y))))`` as the
  input norm of every layer and the post-attention norm of the sparse layers;
- routing without groups when ``n_group`` is null (A.X-K2-Light), and with groups the
  experts outside the kept groups scored 0.0, not -inf (``ZeroMaskedRouter``);
- ``mlp_layer_types``, else the first ``first_k_dense_replace`` (1) layers dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.config import ModelConfig
from warmboot.models.deepseek import _check_groups
from warmboot.models.deepseek_v32 import DeepseekV32ForCausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.indexer import IndexedMLAttention
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm


class GatedRMSNorm(nn.Module):
    """RMSNorm, then an input-dependent sigmoid gate of its output through a ``rank``-wide
    bottleneck (``W_down``, SiLU, ``W_up``: the checkpoint's names)."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.W_down, self.W_up = Linear(hidden, rank), Linear(rank, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        gate = self.W_up(F.silu(self.W_down(y)))
        return (y * torch.sigmoid(gate.float())).to(y.dtype)


class GatedQueryMLA(IndexedMLAttention):
    """Indexed MLA whose query and output gate come from one projection (``q_b_proj`` as
    stored; transformers' ``q_gate_proj``) of the query latent beside its unnormed copy."""

    def __init__(self, *args, q_lora_rank: int, **kwargs):
        super().__init__(*args, q_lora_rank=q_lora_rank, **kwargs)
        width = self.num_heads * (self.nope_dim + self.rope_dim + self.v_dim)
        self.q_b_proj = Linear(2 * q_lora_rank, width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        compressed = self.q_a_proj(x)
        latent = self.q_a_layernorm(compressed)
        both = self.q_b_proj(torch.cat([latent, compressed], dim=-1)).view(n, h, -1)
        q, gate = both.split([self.nope_dim + self.rope_dim, self.v_dim], dim=-1)
        o = self.attend_heads(x, q, latent, positions, attend)
        o = (o * torch.sigmoid(gate.float())).to(o.dtype)
        return self.o_proj(o.reshape(n, h * self.v_dim))


class ZeroMaskedRouter(Router):
    """Group-limited routing that scores the experts outside the kept groups 0.0 (A.X-K2's
    reference), so they stay eligible behind every negative choice score."""

    def _eligible(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.view(choice.shape[0], self.groups, -1)
        kept = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_groups, dim=-1).indices
        mask = torch.ones(grouped.shape[:2], dtype=torch.bool, device=choice.device)
        mask.scatter_(1, kept, False)
        return grouped.masked_fill(mask.unsqueeze(-1), 0.0).view_as(choice)


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    defaults = dict(first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)

    @classmethod
    def check_routing(cls, cfg: ModelConfig, refuse) -> None:
        method = cfg.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            refuse(f"topk_method {method!r} (only noaux_tc)")
        groups, kept = cfg.get("n_group"), cfg.get("topk_group")
        if (groups is None) != (kept is None):
            refuse(f"n_group {groups} with topk_group {kept} (both set or both null)")
        if groups is not None:
            _check_groups(cfg, refuse)
            if cfg.get("n_routed_experts") // groups < 2:
                refuse("groups of one expert (a group scores its best two)")
        if not cfg.get("gated_norm_rank") or cfg.get("gated_norm_rank") < 1:
            refuse(f"gated_norm_rank {cfg.get('gated_norm_rank')!r} (the norms' gate width)")

    def make_layer(self, index: int) -> nn.Module:
        size, eps = self.cfg.hidden_size, self.cfg.get("rms_norm_eps", 1e-6)
        rank = self.cfg.get("gated_norm_rank")
        post = RMSNorm(size, eps) if self.dense_mlp(index) else GatedRMSNorm(size, rank, eps)
        return DecoderLayer(
            self.make_attention(index), self.make_mlp(index), GatedRMSNorm(size, rank, eps), post
        )

    def make_attention(self, index: int) -> nn.Module:
        attn = super().make_attention(index)
        fields = ("nope_dim", "rope_dim", "v_dim", "rope", "spec", "indexer", "topk")
        kwargs = {name: getattr(attn, name) for name in fields}
        return GatedQueryMLA(
            self.cfg.hidden_size,
            attn.num_heads,
            q_lora_rank=attn.q_lora_rank,
            kv_lora_rank=attn.rank,
            bias=bool(self.cfg.get("attention_bias", False)),
            **kwargs,
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, size = cfg.get("hidden_act", "silu"), cfg.get("moe_intermediate_size")
        if self.dense_mlp(index):
            return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act)
        experts, shared = cfg.get("n_routed_experts"), cfg.get("n_shared_experts") or 0
        router = ZeroMaskedRouter(
            cfg.hidden_size,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=bool(self.setting("norm_topk_prob")),
            scale=float(self.setting("routed_scaling_factor")),
            correction_bias=True,
            groups=cfg.get("n_group"),
            topk_groups=cfg.get("topk_group"),
            float32=True,
        )
        return SparseMoE(
            router,
            FusedExperts(experts, cfg.hidden_size, size, act),
            GatedMLP(cfg.hidden_size, size * shared, act) if shared else None,
        )
