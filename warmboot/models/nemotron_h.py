"""Nemotron-H (NVIDIA): a stack of single-mixer blocks ``x + mixer(norm(x))`` with no separate
MLP; each block's kind from ``layers_block_type`` (or ``hybrid_override_pattern``): Mamba 2
(``M``), attention without rope (``*``), a squared-ReLU MLP (``-``) or a MoE (``E``: sigmoid
scores with a correction bias for the choice, group-limited top-k, renormalised and scaled;
non-gated squared-ReLU experts plus a shared MLP). Norms multiply their weight in float32.
The Mamba mixer clamps dt from below at ``time_step_min`` in prefill (its only limit).
Checkpoint names under ``backbone.``; multi-token-prediction weights (``mtp.``) are not read.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.kernels.backend import ATTENTION as BACKEND_ATTENTION
from warmboot.kernels.backend import KVLayout
from warmboot.models.base import STACKED, CausalLM
from warmboot.models.layers.activation import activation
from warmboot.models.layers.attention import Attention
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.mamba2 import Mamba2Mixer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.state import StateMixer

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY = {"mamba": MAMBA, "attention": ATTENTION}


def relu2(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``relu2``: the ReLU squared."""
    return torch.square(F.relu(x))


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32, the product cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class PlainMLP(nn.Module):
    """``down(act(up(x)))``."""

    def __init__(self, hidden: int, intermediate: int, act, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class PlainExperts(FusedExperts):
    """Non-gated experts: ``gate_up_proj`` (E, I, H) holds each expert's up projection alone,
    stacked from one checkpoint tensor per expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act):
        super().__init__(num_experts, hidden, intermediate, act_and_mul=act)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))

    def shard_count(self, leaf: str) -> int:
        return self.num_experts

    def join_shards(self, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts)


class NemotronHBlock(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module):
        super().__init__()
        self.norm, self.mixer = norm, mixer
        self.token_mixer = isinstance(mixer, (Attention, StateMixer))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        h = self.norm(x.to(self.norm.weight.dtype))
        h = self.mixer(h, positions, step) if self.token_mixer else self.mixer(h)
        return x + h


class NemotronHForCausalLM(CausalLM):
    renames = (
        (r"^backbone\.", ""),
        (r"^model\.", ""),
        (r"^embeddings\.", "embed_tokens."),
        (r"^norm_f\.", "norm."),
        (r"\.shared_experts\.", ".shared_expert."),
    )
    stacked = {k: v for k, v in STACKED.items() if k in ("q_proj", "k_proj", "v_proj")}
    """The MLPs are not gated: ``up_proj`` is read as is."""
    expert_projections = {"up_proj": ("gate_up_proj", 0), "down_proj": ("down_proj", 0)}
    ignored = (*CausalLM.ignored, r"^mtp\.")

    def __init__(self, cfg):
        if cfg.get("moe_latent_size") is not None:
            raise UnsupportedModelError("Nemotron-H's moe_latent_size is not served")
        super().__init__(cfg)

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        if types is None:
            pattern = cfg.get("hybrid_override_pattern")
            if pattern is None or set(pattern) - set(PATTERN):
                raise UnsupportedModelError(f"Nemotron-H block pattern {pattern!r} is not served")
            types = [PATTERN[c] for c in pattern]
        types = [LEGACY.get(t, t) for t in types]
        if len(types) != cfg.num_layers:
            raise UnsupportedModelError(
                f"layers_block_type lists {len(types)} blocks, num_hidden_layers is {cfg.num_layers}"
            )
        unknown = sorted(set(types) - set(PATTERN.values()))
        if unknown:
            raise UnsupportedModelError(f"Nemotron-H block kind(s) {unknown} are not served")
        return types

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return NemotronHRMSNorm(size, self.cfg.get("layer_norm_epsilon", 1e-5))

    def make_layer(self, index: int) -> nn.Module:
        kind = self.layer_types()[index]
        if kind == ATTENTION:
            mixer = self.attention(index, rope=None)
        elif kind == MAMBA:
            mixer = self.mamba()
        elif kind == MLP:
            mixer = self.mlp(self.cfg.get("intermediate_size"))
        else:
            mixer = self.moe()
        return NemotronHBlock(self.make_norm(self.cfg.hidden_size), mixer)

    def setting(self, *names: str, default=None):
        """The first of ``names`` the config sets (transformers' legacy ``mamba_*`` keys win)."""
        return next((self.cfg.get(n) for n in names if self.cfg.get(n) is not None), default)

    def mamba(self) -> Mamba2Mixer:
        cfg = self.cfg
        if cfg.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError("a Mamba conv activation other than silu is not served")
        bias = bool(cfg.get("use_bias", False))
        return Mamba2Mixer(
            cfg.hidden_size,
            num_heads=cfg.get("mamba_num_heads", 128),
            head_dim=cfg.get("mamba_head_dim", 64),
            n_groups=self.setting("mamba_n_groups", "n_groups", default=8),
            d_state=cfg.get("ssm_state_size", 128),
            conv_kernel=self.setting("mamba_d_conv", "conv_kernel", default=4),
            chunk_size=self.setting("mamba_chunk_size", "chunk_size", default=128),
            eps=cfg.get("layer_norm_epsilon", 1e-5),
            conv_bias=bool(self.setting("mamba_conv_bias", "use_conv_bias", default=True)),
            in_bias=bias,
            out_bias=bias,
            dt_limit=(self.setting("mamba_dt_min", "time_step_min", default=0.001), math.inf),
        )

    def mlp(self, intermediate: int) -> PlainMLP:
        cfg = self.cfg
        return PlainMLP(cfg.hidden_size, intermediate, self.act(), bool(cfg.get("mlp_bias", False)))

    def act(self):
        name = self.cfg.get("mlp_hidden_act", "relu2")
        return relu2 if name == "relu2" else activation(name)

    def moe(self) -> SparseMoE:
        cfg = self.cfg
        experts, groups = cfg.get("n_routed_experts", 8), cfg.get("n_group", 1)
        router = Router(
            cfg.hidden_size,
            experts,
            cfg.get("num_experts_per_tok", 2),
            scoring="sigmoid",
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scale=cfg.get("routed_scaling_factor", 1.0),
            correction_bias=True,
            groups=groups if groups > 1 else None,
            topk_groups=cfg.get("topk_group", 1) if groups > 1 else None,
            float32=True,
        )
        plain = PlainExperts(experts, cfg.hidden_size, cfg.get("moe_intermediate_size"), self.act())
        shared = self.mlp(cfg.get("moe_shared_expert_intermediate_size"))
        return SparseMoE(router, plain, shared)

    def with_states(self, layout: KVLayout) -> KVLayout:
        """Per block its kind (MLP and MoE blocks, which neither attend nor keep a state, as
        ``mlp`` and ``moe``) and a Mamba block's states."""
        blocks = list(zip(self.layer_types(), self.state_mixers(), strict=True))
        kinds = tuple(
            BACKEND_ATTENTION if t == ATTENTION else t if m is None else m.kind for t, m in blocks
        )
        states = tuple(() if m is None else m.state_specs() for _, m in blocks)
        return dataclasses.replace(layout, kinds=kinds, states=states)

    def sliding_window(self, index: int) -> int | None:
        return None  # NOTE: transformers' Nemotron-H attention ignores ``sliding_window``

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        mapped = super().map_name(name)
        if mapped is not None and mapped[0].endswith(".experts.gate_up_proj"):
            return mapped[0], mapped[1] // 2  # NOTE: one (up) tensor per expert, not gate + up
        return mapped
