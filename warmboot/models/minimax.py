"""MiniMax (MiniMax-Text-01's transformers port): lightning attention layers
(``linear_attention``, ``layers/lightning.py``) beside softmax attention layers
(``full_attention``, GQA with rope, windowed when ``sliding_window`` is set), as
``layer_types`` lists them (default: even layers attend); every layer's MLP is Mixtral's
sparse block (softmax top-k, renormalised).

The residual is taken *after* each norm: ``x = norm(x)``, then
``x = alpha * x + beta * mixer(x)``, the same around the MLP, with the config's
``{full,linear}_attn_{alpha,beta}_factor`` and ``mlp_{alpha,beta}_factor``.

Refused by name: settings of the original MiniMax code that transformers 5.23 reads no
further (a rope over part of each head, ``rotary_dim`` / ``partial_rotary_factor``;
``postnorm`` false; a shared expert), as no reference gives their outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import STACKED, CausalLM, checked_kinds
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.lightning import LightningAttention
from warmboot.models.mixtral import MixtralForCausalLM

KINDS = ("full_attention", "linear_attention")


class MiniMaxDecoderLayer(nn.Module):
    """``x = norm(x); x = a * x + b * mixer(x)``, then the same around the MLP:
    ``scales`` = (mixer alpha, mixer beta, MLP alpha, MLP beta)."""

    def __init__(self, mixer, mlp, input_layernorm, post_attention_layernorm, scales):
        super().__init__()
        self.self_attn, self.mlp = mixer, mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.scales = tuple(float(s) for s in scales)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        a1, b1, a2, b2 = self.scales
        x = self.input_layernorm(x)
        x = _mix(x, a1, self.self_attn(x, positions, attend), b1)
        x = self.post_attention_layernorm(x)
        return _mix(x, a2, self.mlp(x), b2)


def _mix(x: torch.Tensor, a: float, h: torch.Tensor, b: float) -> torch.Tensor:
    """``a * x + b * h`` (a factor of 1 skipped: the same values)."""
    x = x if a == 1.0 else x * a
    return x + (h if b == 1.0 else h * b)


class MiniMaxForCausalLM(MixtralForCausalLM):
    stacked = STACKED | {"qkv_proj": ("in_proj", 0), "output_gate": ("in_proj", 1)}
    """The lightning layers' q/k/v and gate projections as one (their attention layers'
    ``q_proj``/``k_proj``/``v_proj`` stack into ``qkv_proj`` as usual)."""
    ignored = (
        *CausalLM.ignored,
        r"self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$",
    )
    """transformers saves the lightning layers' decay tables; they follow from the config."""

    def __init__(self, cfg: ModelConfig):
        _refuse_unserved(cfg)
        super().__init__(cfg)

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is None:
            types = [KINDS[i % 2] for i in range(cfg.num_layers)]
        return checked_kinds(types, cfg.num_layers, KINDS, "MiniMax ")

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == "linear_attention":
            mixer, prefix = self.lightning(index), "linear_attn"
        else:
            mixer, prefix = self.attention(index), "full_attn"
        scales = [
            cfg.get(f"{name}_{part}_factor", 1)
            for name in (prefix, "mlp")
            for part in ("alpha", "beta")
        ]
        norm = self.make_norm
        return MiniMaxDecoderLayer(
            mixer, self.make_mlp(index), norm(cfg.hidden_size), norm(cfg.hidden_size), scales
        )

    def lightning(self, index: int) -> LightningAttention:
        cfg = self.cfg
        return LightningAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.head_dim,
            index,
            cfg.num_layers,
            cfg.get("hidden_act", "silu"),
        )

    def sliding_window(self, index: int) -> int | None:
        return self.cfg.get("sliding_window")  # NOTE: every attention layer's, as transformers


def _refuse_unserved(cfg: ModelConfig) -> None:
    rotary = cfg.get("rotary_dim", cfg.head_dim)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rotary != cfg.head_dim or partial != 1.0:
        raise UnsupportedModelError(
            f"MiniMax with rope over part of each head (rotary_dim {rotary}, head_dim "
            f"{cfg.head_dim}, partial_rotary_factor {partial}): transformers 5.23 rotates the "
            "whole head, the original code part of it; not served"
        )
    if cfg.get("postnorm") is False:
        raise UnsupportedModelError("MiniMax postnorm false (residual before the norms)")
    if cfg.get("shared_intermediate_size", 0):
        raise UnsupportedModelError("MiniMax shared_intermediate_size: a shared expert")
