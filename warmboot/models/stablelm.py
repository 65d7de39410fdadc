"""StableLM (3B-4E1T, StableLM 2): Llama's gated MLP with LayerNorms (biased), partial rotary,
optional q/k/v biases, optional q/k LayerNorms with one weight per head (stored as one
tensor per head), and the parallel residual ``x + attn(ln(x)) + mlp(ln(x))`` (12B)."""

from __future__ import annotations

import re

import torch
from torch import nn

from warmboot.models.layers.attention import Attend
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.phi import ParallelLayer

HEAD_NORM = re.compile(r"^(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight$")


class StableLmParallelLayer(ParallelLayer):
    """``x + attn + mlp`` (transformers' order)."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, positions, attend) + self.mlp(h)


class HeadLayerNorm(LayerNorm):
    """A bias-free LayerNorm with one weight row per head; the checkpoint's per-head
    weights are its shards (stacked by the loader, ``StableLmForCausalLM.transform``)."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__((heads, head_dim), eps, bias=False)
        self.shards = (head_dim,) * heads

    shard_count = Linear.shard_count

    def join_shards(self, leaf: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)


class StableLmForCausalLM(LlamaForCausalLM):
    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if not cfg.get("use_parallel_residual", False):
            return super().make_layer(index)
        attn = self.attention(index, **self.attention_options())
        return StableLmParallelLayer(attn, self.make_mlp(index), self.make_norm(cfg.hidden_size))

    def attention_options(self) -> dict:
        cfg = self.cfg
        options = dict(qkv_bias=bool(cfg.get("use_qkv_bias", False)), o_bias=False)
        if cfg.get("qk_layernorm", False):
            eps = cfg.get("layer_norm_eps", 1e-5)
            options["q_norm"] = HeadLayerNorm(cfg.num_heads, cfg.head_dim, eps)
            options["k_norm"] = HeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, eps)
        return options

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("layer_norm_eps", 1e-5))

    def rope_spec(self, **overrides) -> RopeSpec:
        partial = self.cfg.get("partial_rotary_factor", 0.25)
        return super().rope_spec(**(dict(partial_rotary_factor=partial) | overrides))

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """``...self_attn.q_layernorm.norms.<h>.weight`` -> shard ``h`` of ``q_norm.weight``."""
        m = HEAD_NORM.match(name)
        if m is None:
            return super().map_name(name)
        prefix, which, head = m.groups()
        return super().map_name(f"{prefix}{which}_norm.weight")[0], int(head)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return tensor.reshape(-1, self.cfg.head_dim)
        return tensor
