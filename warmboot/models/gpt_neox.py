"""GPT-NeoX (Pythia): LayerNorms with biases, q/k/v fused per head in the checkpoint, partial
rotary (``rotary_pct``), a plain MLP, and the parallel residual
``x + attn(ln1(x)) + mlp(ln2(x))`` (or the sequential one)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.norm import LayerNorm
from warmboot.models.layers.rope import RopeSpec


class ParallelDecoderLayer(DecoderLayer):
    """``mlp(ln2(x)) + attn(ln1(x)) + x``, summed in transformers' order."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, attend)
        return self.mlp(self.post_attention_layernorm(x)) + attn + x


class GPTNeoXForCausalLM(CausalLM):
    renames = (
        (r"^gpt_neox\.", ""),
        (r"^embed_in\.", "embed_tokens."),
        (r"^final_layer_norm\.", "norm."),
        (r"^embed_out\.", "lm_head."),
        (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
        (r"\.attention\.dense\.", ".self_attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
    )
    stacked = {}  # NOTE: q/k/v come fused; ``up_proj`` is not a gate/up shard here
    ignored = (
        *CausalLM.ignored,
        r"\.attention\.bias$",  # NOTE: old checkpoints' causal-mask buffer
        r"\.attention\.masked_bias$",  # and its fill value
    )

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        bias = bool(cfg.get("attention_bias", True))
        attn = self.attention(index, qkv_bias=bias, o_bias=bias)
        mlp = MLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "gelu"))
        norms = self.make_norm(cfg.hidden_size), self.make_norm(cfg.hidden_size)
        parallel = cfg.get("use_parallel_residual", True)
        return (ParallelDecoderLayer if parallel else DecoderLayer)(attn, mlp, *norms)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("layer_norm_eps", 1e-5))

    def rope_spec(self, **overrides) -> RopeSpec:
        # NOTE: transformers reads ``rotary_emb_base``/``rotary_pct`` (not ``rope_theta``)
        # unless ``rope_parameters`` says
        cfg = self.cfg
        defaults = dict(
            theta=cfg.get("rotary_emb_base", 10000.0),
            partial_rotary_factor=cfg.get("rotary_pct", 0.25),
        )
        return super().rope_spec(**(defaults | overrides))

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v, per head ``[q_h, k_h, v_h]`` in the checkpoint, into q, k, v."""
        if ".self_attn.qkv_proj." not in name:
            return tensor
        heads, head_dim = self.cfg.num_heads, self.cfg.head_dim
        return tensor.reshape(heads, 3, head_dim, -1).transpose(0, 1).reshape(tensor.shape)
