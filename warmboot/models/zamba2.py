"""Zamba 2 (Zyphra): Mamba 2 layers, and at the ``hybrid`` entries of ``layers_block_type`` a
shared transformer block before the layer's Mamba mixer.

A Mamba layer is ``x + mamba(norm(x))``. A hybrid layer first runs one of ``num_mem_blocks``
shared blocks (the k-th hybrid layer block ``k % num_mem_blocks``; its weights stored once,
under its first layer; with ``tie_word_embeddings: false`` transformers 5 ties none, so each
hybrid layer has a block of its own) on ``concat(x, embeddings)``: RMSNorm over the 2H
channels, attention (head dim ``2H / heads``, scores scaled by ``(head_dim / 2) ** -0.5``,
rope only with ``use_mem_rope``), RMSNorm, a gated MLP, with no residual; the invocation's
own LoRA adapters add to q/k/v (``use_shared_attention_adapter``) and, always, to gate/up. A
per-layer ``linear`` maps the block's output ``t``; the layer is ``x + mamba(norm(x + t))``.

Each invocation attends over its own K/V (its inputs differ): a hybrid layer is an attention
layer of the KV layout that also keeps its mixer's state (as Falcon-H1's layers). The word
embeddings ride through the layers beside the residual stream, as the second half of one
(N, 2H) tensor, so a layer keeps the ``layer(x, positions, step)`` form of the compiled step.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.kernels.backend import ATTENTION, AttentionSpec, KVLayout
from warmboot.models.base import CausalLM, checked_kinds
from warmboot.models.layers.activation import activation
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.mamba2 import Mamba2Mixer
from warmboot.models.layers.norm import RMSNorm

MAMBA, HYBRID = "linear_attention", "hybrid"
LEGACY = {"mamba": MAMBA}
MAMBA_NORM_EPS = 1e-5
"""The gated norm of the Mamba output: a fixed eps in transformers, not ``rms_norm_eps``."""
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")
_ADAPTER = re.compile(
    r"^(?:self_attn\.linear_([qkv])|feed_forward\.gate_up_proj)_adapter_list"
    r"\.(\d+)\.([01])\.weight$"
)
"""An invocation's adapter inside a shared block: q/k/v (or None: gate/up), its hybrid
layer's number among the hybrid layers, down (0) or up (1)."""


class LoRA(nn.Module):
    """``up(down(x))``: an invocation's adapter on a shared projection."""

    def __init__(self, size_in: int, rank: int, size_out: int):
        super().__init__()
        self.down = Linear(size_in, rank)
        self.up = Linear(rank, size_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class QKVAdapter(nn.Module):
    """The q, k and v adapters of one invocation: their down projections stacked in one."""

    def __init__(self, size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.down = Linear(size, [rank, rank, rank])
        self.up_q, self.up_k, self.up_v = (Linear(rank, size) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.down(x).split(self.rank, dim=-1)
        return torch.cat([self.up_q(q), self.up_k(k), self.up_v(v)], dim=-1)


class SharedAttention(nn.Module):
    """The shared block's attention: stacked q/k/v from the 2H-wide input, o_proj to H."""

    def __init__(self, size_in, size_out, heads, kv_heads, head_dim, rope, spec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.qkv_proj = Linear(size_in, list(self.sizes))
        self.o_proj = Linear(heads * head_dim, size_out)
        self.rope, self.spec = rope, spec

    def forward(self, h, positions, attend, adapter: QKVAdapter | None) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv_proj(h)
        if adapter is not None:
            qkv = qkv + adapter(h)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(n, self.heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(positions, q, k)
        return self.o_proj(attend(q, k, v).reshape(n, -1))


class SharedBlock(nn.Module):
    """One shared transformer block (weights held once, called by several layers)."""

    def __init__(self, attn: SharedAttention, hidden, intermediate, act, bias, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.self_attn = attn
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, xe, positions, attend, qkv_adapter, mlp_adapter) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(xe), positions, attend, qkv_adapter)
        h = self.pre_ff_layernorm(h)
        gate, up = (self.gate_up_proj(h) + mlp_adapter(h)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class ZambaLayer(nn.Module):
    """``x + mamba(norm(x + t))`` on the first half of ``(x, embeddings)``; in a hybrid layer
    ``t`` is ``linear`` of the shared block's output (with this invocation's adapters), else
    none. The block is registered first, so its linears take the same places (slots) in
    every layer that calls it."""

    def __init__(self, mamba, norm, block=None, qkv_adapter=None, mlp_adapter=None, linear=None):
        super().__init__()
        self.shared = block
        self.qkv_adapter, self.mlp_adapter, self.linear = qkv_adapter, mlp_adapter, linear
        self.input_layernorm, self.mamba = norm, mamba

    def forward(self, xe: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        x, emb = xe.chunk(2, dim=-1)
        h = x
        if self.shared is not None:
            t = self.shared(xe, positions, step, self.qkv_adapter, self.mlp_adapter)
            h = x + self.linear(t)
        out = x + self.mamba(self.input_layernorm(h), positions, step)
        return torch.cat([out, emb], dim=-1)


class ResidualNorm(RMSNorm):
    """The final norm, of the residual half of ``(x, embeddings)``."""

    def forward(self, xe: torch.Tensor) -> torch.Tensor:
        return super().forward(xe[:, : self.weight.shape[0]])


class Zamba2ForCausalLM(CausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^final_layernorm\.", "norm."),
        (r"\.mamba_decoder\.", "."),
        (r"^(blocks\.\d+)\.feed_forward\.", r"\1."),
    )
    tied_by_default = True

    def __init__(self, cfg):
        # NOTE: as transformers derives them (a saved attention_head_dim is not read)
        head_dim = 2 * cfg.hidden_size // cfg.num_heads
        long = 16384 if cfg.get("use_long_context") else cfg.max_position_embeddings
        cfg = dataclasses.replace(cfg, head_dim=head_dim, max_position_embeddings=long)
        self.types = zamba2_layer_types(cfg)
        self.hybrid_ids = [i for i, t in enumerate(self.types) if t == HYBRID]
        self.mem_blocks = cfg.get("num_mem_blocks", 1)
        if self.mem_blocks < 1:
            raise UnsupportedModelError(f"num_mem_blocks {self.mem_blocks} is not served")
        # NOTE: transformers ties the blocks with the embeddings: untied, each layer its own
        shared = bool(cfg.get("tie_word_embeddings", True))
        self.block_of = {
            i: k % self.mem_blocks if shared else k for k, i in enumerate(self.hybrid_ids)
        }
        check_settings(cfg)
        super().__init__(cfg)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        norm = RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-5))
        if self.types[index] == MAMBA:
            return ZambaLayer(self.mamba(), norm)
        rank, hidden = cfg.get("adapter_rank", 128), cfg.hidden_size
        qkv = QKVAdapter(2 * hidden, rank) if cfg.get("use_shared_attention_adapter") else None
        mlp = LoRA(hidden, rank, 2 * cfg.get("intermediate_size", 4 * hidden))
        block = self.shared_block(self.block_of[index])
        return ZambaLayer(self.mamba(), norm, block, qkv, mlp, Linear(hidden, hidden))

    def make_norm(self, size: int) -> nn.Module:
        return ResidualNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def shared_block(self, b: int) -> SharedBlock:
        """Shared block ``b``, built on first use; ``blocks`` is registered before the
        layers, so its weights are named ``blocks.<b>.`` (once)."""
        if "blocks" not in self._modules:
            used = len(set(self.block_of.values()))
            self.blocks = nn.ModuleList(self._new_block() for _ in range(used))
        return self.blocks[b]

    def _new_block(self) -> SharedBlock:
        cfg = self.cfg
        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        rope = self.shared_rope(self.rope_spec()) if cfg.get("use_mem_rope") else None
        spec = AttentionSpec(scale=(head_dim / 2) ** -0.5)
        attn = SharedAttention(
            2 * hidden, hidden, cfg.num_heads, cfg.num_kv_heads, head_dim, rope, spec
        )
        intermediate = cfg.get("intermediate_size", 4 * hidden)
        act, bias = cfg.get("hidden_act", "gelu"), bool(cfg.get("add_bias_linear", False))
        return SharedBlock(attn, hidden, intermediate, act, bias, cfg.get("rms_norm_eps", 1e-5))

    def mamba(self) -> Mamba2Mixer:
        cfg = self.cfg
        heads = cfg.get("n_mamba_heads", 8)
        inner = int(cfg.get("mamba_expand", 2) * cfg.hidden_size)
        bias = bool(cfg.get("add_bias_linear", False))
        return Mamba2Mixer(
            cfg.hidden_size,
            num_heads=heads,
            head_dim=inner // heads,
            n_groups=cfg.get("mamba_ngroups", 1),
            d_state=cfg.get("mamba_d_state", 64),
            conv_kernel=cfg.get("mamba_d_conv", 4),
            chunk_size=cfg.get("chunk_size", 256),
            eps=MAMBA_NORM_EPS,
            conv_bias=True,  # NOTE: transformers' conv always has one (use_conv_bias unread)
            in_bias=bias,
            out_bias=bias,
            dt_limit=(cfg.get("time_step_min", 0.001), float("inf")),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return torch.cat([x, x], dim=-1)

    def with_states(self, layout: KVLayout) -> KVLayout:
        """Every layer keeps its mixer's state; a hybrid layer also attends."""
        mixers, attns = self.state_mixers(), self.attention_layers()
        kinds = tuple(
            m.kind if a is None else ATTENTION for m, a in zip(mixers, attns, strict=True)
        )
        states = tuple(m.state_specs() for m in mixers)
        return dataclasses.replace(layout, kinds=kinds, states=states)

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """A shared block's tensors -> ``blocks.<b>`` (the copy under the block's first layer:
        transformers reads no other); the adapters it holds for each invocation
        (``..._adapter_list.<j>``) -> the j-th hybrid layer's."""
        shared = _SHARED.match(name)
        if shared is None:
            return super().map_name(name)
        layer, rest = int(shared[1]), shared[2]
        if layer not in self.block_of:
            return name, None  # NOTE: not ours: refused as unread
        b = self.block_of[layer]
        if self.hybrid_ids[b] != layer:
            return None  # NOTE: a tied copy of the first layer's block
        adapter = _ADAPTER.match(rest)
        if adapter is None:
            return super().map_name(f"blocks.{b}.{rest}")
        j, ids = int(adapter[2]), self.hybrid_ids
        if j < len(ids) and self.block_of[ids[j]] == b:
            return self._adapter_name(ids[j], adapter[1], adapter[3])
        if j < len(ids) and j % self.mem_blocks == b % self.mem_blocks:
            return None  # NOTE: an untied block's entry for another layer: never called
        return name, None

    @staticmethod
    def _adapter_name(index: int, which: str | None, part: str) -> tuple[str, int | None]:
        layer = f"layers.{index}"
        if which is None:
            return f"{layer}.mlp_adapter.{'down' if part == '0' else 'up'}.weight", None
        if part == "0":
            return f"{layer}.qkv_adapter.down.weight", "qkv".index(which)
        return f"{layer}.qkv_adapter.up_{which}.weight", None


def zamba2_layer_types(cfg) -> list[str]:
    """``layers_block_type`` (legacy ``mamba`` accepted): Mamba 2 or hybrid per layer."""
    types = cfg.get("layers_block_type")
    if types is None:
        raise UnsupportedModelError("config.json lacks layers_block_type (Zamba2)")
    types = [LEGACY.get(t, t) for t in types]
    return checked_kinds(types, cfg.num_layers, (MAMBA, HYBRID), "Zamba2 ")


def check_settings(cfg) -> None:
    """Refuse by name what the layers would compute otherwise than transformers."""
    hidden, heads = cfg.hidden_size, cfg.num_heads
    if cfg.get("use_shared_attention_adapter") and (
        cfg.num_kv_heads != heads or 2 * hidden % heads
    ):
        raise UnsupportedModelError(
            "use_shared_attention_adapter with num_key_value_heads != num_attention_heads or "
            "2 x hidden_size not a multiple of the heads (each adapter is 2 x hidden wide)"
        )
    inner, mamba_heads = int(cfg.get("mamba_expand", 2) * hidden), cfg.get("n_mamba_heads", 8)
    if inner % mamba_heads or mamba_heads % cfg.get("mamba_ngroups", 1):
        raise UnsupportedModelError(
            f"n_mamba_heads {mamba_heads} must divide mamba_expand x hidden ({inner}) and be "
            f"a multiple of mamba_ngroups"
        )
    activation(cfg.get("hidden_act", "gelu"))  # NOTE: refuses an unknown one by name
