"""HRM-Text (Sapient, ``HrmTextForCausalLM``): two stacks of the same pre-norm decoder layers
(weightless RMSNorms, multi-head attention whose output is multiplied elementwise by the
sigmoid of a separate ``gate_proj`` of the layer's input, a gated MLP), each ending in a
weightless RMSNorm, run as a fixed recurrence over two streams: ``z_H`` starts as the
embeddings times ``embedding_scale``, ``z_L`` as the learned ``z_L_init``; each of
``H_cycles`` cycles runs ``z_L = L(z_L + z_H)`` ``L_cycles`` times, then ``z_H = H(z_H +
z_L)``; the LM head reads ``z_H`` (no final norm of the model's own).

Nothing in it depends on the data, and every attention call is causal: the engine sees each
call of a stack's layer as a layer of its own (``StackCall``, ``per_stack * H_cycles *
(L_cycles + 1)`` of them, transformers' ``num_hidden_layers`` and its cache's slots, in its
order), with a KV cache of its own; the calls of one stack's layer ``j`` share its weights
(``tie_weights``: the loader assigns the first call's, the snapshot keeps those alone). The
two streams ride between the layers as one ``(N, 2 * hidden)`` row ``[z_H, z_L]``.

``prefix_lm``: transformers makes the block of ``token_type_ids == 1`` bidirectional when it
is given them; without them (the engine's requests) every call is causal, as served here.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig, hrm_calls
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.base import STACKED, CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.rope import RotaryEmbedding
from warmboot.models.nanochat import UnitRMSNorm

_STACK = re.compile(r"^model\.([HL])_module\.layers\.(\d+)\.")
_ATTN_GATE = re.compile(r"\.self_attn\.gate_proj\.")
_SAVED_ATTN = re.compile(r"\.attn\.(gqkv_proj|o_proj)\.")
"""transformers saves the gate, q, k, v weights as one ``attn.gqkv_proj`` (in that order)."""


class GatedMHA(nn.Module):
    """Multi-head attention (K/V heads as many as queries), rope, and the output times the
    elementwise sigmoid of the gate projection before ``o_proj``; gate, q, k, v as one
    stacked projection (``gqkv_proj``)."""

    def __init__(self, hidden, heads, head_dim, *, rope: RotaryEmbedding, spec, bias: bool):
        super().__init__()
        self.num_heads, self.head_dim, self.size = heads, head_dim, heads * head_dim
        self.gqkv_proj = Linear(hidden, [self.size] * 4, bias=bias)
        self.o_proj = Linear(self.size, hidden, bias=bias)
        self.rope, self.spec = rope, spec

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n, shape = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
        gate, q, k, v = self.gqkv_proj(x).split(self.size, dim=-1)
        q, k = self.rope(positions, q.reshape(shape), k.reshape(shape))
        o = attend(q, k, v.reshape(shape)).reshape(n, self.size)
        return self.o_proj(o * torch.sigmoid(gate))


class StackCall(DecoderLayer):
    """Layer ``j`` of a stack in one call of it, on the row ``[z_H, z_L]``: the stream it
    updates (``z_L`` in the L stack, ``z_H`` in the H) goes through the layer, plus the other
    stream first (``first``: the stack's layer 0), through the stack's final norm after
    (``final_norm``: its last layer)."""

    def __init__(self, *parts: nn.Module, low: bool, first: bool, final_norm: nn.Module | None):
        super().__init__(*parts)
        self.low, self.first, self.final_norm = low, first, final_norm

    def forward(self, row: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        high, low = row.chunk(2, dim=-1)
        x, other = (low, high) if self.low else (high, low)
        if self.first:
            x = x + other
        x = super().forward(x, positions, attend)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return torch.cat([high, x] if self.low else [x, low], dim=-1)


class HighStream(nn.Module):
    """The model's last step: ``z_H`` of the row (normed by the H stack already)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, : self.hidden].contiguous()


class HrmTextForCausalLM(CausalLM):
    stacked = {
        "attn_gate_proj": ("gqkv_proj", 0),
        "q_proj": ("gqkv_proj", 1),
        "k_proj": ("gqkv_proj", 2),
        "v_proj": ("gqkv_proj", 3),
        "gate_proj": STACKED["gate_proj"],
        "up_proj": STACKED["up_proj"],
    }

    def __init__(self, cfg: ModelConfig):
        self.check(cfg)
        # NOTE: always multi-head; transformers' head_dim default is 128, not hidden / heads
        head_dim = cfg.get("head_dim", 128)
        cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads, head_dim=head_dim)
        _, self.per_stack, self.h_cycles, self.l_cycles = hrm_calls(cfg.hf)
        super().__init__(cfg)
        self.embed_scale = float(
            cfg.get("embedding_scale", 1.0 / cfg.get("initializer_range", 0.02))
        )
        self.z_L_init = nn.Parameter(torch.empty(cfg.hidden_size))
        self.norm = HighStream(cfg.hidden_size)

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        def refuse(reason: str):
            raise UnsupportedModelError(f"{cfg.architecture}: unsupported {reason}")

        _, per_stack, high, low = hrm_calls(cfg.hf)
        if per_stack < 1 or high < 1 or low < 1:
            refuse(f"num_layers_per_stack {per_stack}, H_cycles {high}, L_cycles {low} (each >= 1)")
        if cfg.get("num_key_value_heads") not in (None, cfg.num_heads):
            refuse("num_key_value_heads unlike num_attention_heads (transformers' is MHA)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        for factor in (cfg.get("partial_rotary_factor"), rope.get("partial_rotary_factor")):
            if factor not in (None, 1.0):
                refuse(f"partial_rotary_factor {factor}")

    # -- composition ----------------------------------------------------------------------------
    def call_of(self, index: int) -> tuple[bool, int]:
        """Engine layer ``index``: (whether an L-stack call, the stack's layer)."""
        call, layer = divmod(index, self.per_stack)
        return call % (self.l_cycles + 1) < self.l_cycles, layer

    def owner(self, index: int) -> int:
        """The engine layer holding the weights of layer ``index``: its stack's first call."""
        low, layer = self.call_of(index)
        return layer if low else self.l_cycles * self.per_stack + layer

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        low, layer = self.call_of(index)
        size = cfg.hidden_size
        act, bias = cfg.get("hidden_act", "silu"), bool(cfg.get("mlp_bias", False))
        attn = GatedMHA(
            size,
            cfg.num_heads,
            cfg.head_dim,
            rope=self.shared_rope(self.rope_spec()),
            spec=AttentionSpec(scale=cfg.head_dim**-0.5),
            bias=bool(cfg.get("attention_bias", False)),
        )
        mlp = GatedMLP(size, cfg.get("intermediate_size"), act, bias)
        last = layer == self.per_stack - 1
        final = self.make_norm(size) if last else None
        parts = (attn, mlp, self.make_norm(size), self.make_norm(size))
        return StackCall(*parts, low=low, first=layer == 0, final_norm=final)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return UnitRMSNorm(self.cfg.get("rms_norm_eps", 1e-6))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        high = super().embed(input_ids)
        return torch.cat([high, self.z_L_init.expand_as(high)], dim=-1)

    def tie_weights(self) -> None:
        """Every call of a stack's layer on its first call's weights (the ones loaded)."""
        super().tie_weights()
        for index, layer in enumerate(self.layers):
            owner = self.layers[self.owner(index)]
            if owner is layer:
                continue
            for name, param in owner.named_parameters():
                path, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(path), leaf, param)

    # -- checkpoint names -----------------------------------------------------------------------
    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """A stack's layer ``j`` onto its first call's engine layer; the attention's gate
        apart from the MLP's; the saved ``attn.*`` names onto ``self_attn``."""
        found = _STACK.match(name)
        if found and int(found[2]) < self.per_stack:  # NOTE: past it: refused as unread
            j = int(found[2])
            index = j if found[1] == "L" else self.l_cycles * self.per_stack + j
            name = f"model.layers.{index}.{name[found.end() :]}"
            name = _SAVED_ATTN.sub(r".self_attn.\1.", name)
            name = _ATTN_GATE.sub(".self_attn.attn_gate_proj.", name)
        return super().map_name(name)
