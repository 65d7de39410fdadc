"""AFMoE (Arcee Trinity, ``AfmoeForCausalLM``): GLM-4's sandwich norms (a norm before and
after attention and MLP) around attention with per-head q/k RMSNorm, rope on the windowed
``sliding_attention`` layers only (the full layers are NoPE) and an output gate from its own
``gate_proj`` (``o_proj(attn * sigmoid(gate_proj(x)))``, stacked beside q here); MoE after
``num_dense_layers`` dense layers: sigmoid routing with a choice-only ``expert_bias``,
renormalised, times ``route_scale``, plus shared experts; embeddings times
``sqrt(hidden_size)`` when ``mup_enabled``."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import STACKED
from warmboot.models.glm4 import Glm4DecoderLayer
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM


class AfmoeForCausalLM(LlamaForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.post_attention_layernorm\.", ".post_self_attn_layernorm."),
        (r"\.pre_mlp_layernorm\.", ".post_attention_layernorm."),
        (r"\.self_attn\.gate_proj\.", ".self_attn.attn_gate_proj."),
        (r"\.mlp\.router\.gate\.", ".mlp.gate."),
        (r"\.mlp\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    )
    stacked = STACKED | {"attn_gate_proj": ("qkv_proj", 1), "k_proj": ("qkv_proj", 2)}
    stacked |= {"v_proj": ("qkv_proj", 3)}

    def __init__(self, cfg: ModelConfig):
        if cfg.get("attention_bias", False):
            raise UnsupportedModelError(f"{cfg.architecture}: attention_bias (gate has none)")
        super().__init__(cfg)
        if cfg.get("mup_enabled", False):
            self.embed_scale = cfg.hidden_size**0.5

    def make_layer(self, index: int) -> nn.Module:
        cfg, d = self.cfg, self.cfg.head_dim
        nope = {} if self.sliding_window(index) is not None else dict(rope=None)
        attn = self.attention(
            index, q_norm=self.make_norm(d), k_norm=self.make_norm(d), output_gate=True, **nope
        )
        q, kv = attn.q_size, attn.kv_size
        attn.qkv_proj = Linear(cfg.hidden_size, [q, q, kv, kv])  # NOTE: q, gate, k, v
        norms = [self.make_norm(cfg.hidden_size) for _ in range(4)]
        return Glm4DecoderLayer(attn, self.make_mlp(index), *norms)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        if index < cfg.get("num_dense_layers", 1):
            return GatedMLP(hidden, cfg.get("intermediate_size"), act)
        experts, size = cfg.get("num_experts"), cfg.get("moe_intermediate_size")
        shared = cfg.get("num_shared_experts") or 0
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=True,
            scale=float(cfg.get("route_scale", 1.0)),
            correction_bias=True,
        )
        return SparseMoE(
            router,
            FusedExperts(experts, hidden, size, act),
            GatedMLP(hidden, size * shared, act) if shared else None,
        )

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """[q; gate; k; v] rows -> each head's query then its gate (``output_gate``'s order)."""
        if not name.endswith("self_attn.qkv_proj.weight"):
            return tensor
        cfg = self.cfg
        q_size = cfg.num_heads * cfg.head_dim
        q, gate, kv = tensor.split([q_size, q_size, tensor.shape[0] - 2 * q_size])
        heads = torch.stack([t.view(cfg.num_heads, cfg.head_dim, -1) for t in (q, gate)], 1)
        return torch.cat([heads.reshape(2 * q_size, -1), kv])
