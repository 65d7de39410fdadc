"""Jamba (AI21): Mamba 1 layers (``layers/mamba1.py``, dt's input, B and C RMS-normalised
with weights) beside attention layers without positional encoding, one every
``attn_layer_period`` layers from ``attn_layer_offset``; each block pre-norm
(``input_layernorm``, ``pre_ff_layernorm``) over a gated MLP, or, every
``expert_layer_period`` layers from ``expert_layer_offset``, ``num_experts`` experts picked
by softmax then top-k (their weights not renormalised)."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.granitemoehybrid import ATTENTION, MAMBA
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.mamba1 import Mamba1Mixer
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.mamba import dt_rank, silu_conv


def periodic(cfg, name: str, period: int, offset: int) -> list[bool]:
    """Per layer, whether ``index % period == offset`` (``<name>_layer_period`` / offset)."""
    if not 0 <= offset < period:
        raise UnsupportedModelError(
            f"{name}_layer_offset {offset} is not within {name}_layer_period {period}"
        )
    return [i % period == offset for i in range(cfg.num_layers)]


class JambaForCausalLM(LlamaForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^final_layernorm\.", "norm."),
        (r"\.mamba\.", ".self_attn."),
        (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.", ".mlp."),
        (r"\.mlp\.router\.", ".mlp.gate."),
    )

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        attn = periodic(
            cfg, "attn", cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        )
        return [ATTENTION if a else MAMBA for a in attn]

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == ATTENTION:
            mixer = self.attention(index, rope=None, **self.attention_options())
        else:
            mixer = self.mamba_mixer()
        norm = self.make_norm
        return DecoderLayer(
            mixer, self.make_mlp(index), norm(cfg.hidden_size), norm(cfg.hidden_size)
        )

    def mamba_mixer(self) -> Mamba1Mixer:
        cfg = self.cfg
        silu_conv(cfg)
        hidden = cfg.hidden_size
        return Mamba1Mixer(
            hidden,
            inner=int(cfg.get("mamba_expand", 2) * hidden),
            d_state=cfg.get("mamba_d_state", 16),
            dt_rank=dt_rank(cfg.get("mamba_dt_rank"), hidden),
            conv_kernel=cfg.get("mamba_d_conv", 4),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
            bcdt_norm="weighted",
            eps=cfg.get("rms_norm_eps", 1e-6),
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts = cfg.get("num_experts", 16)
        period, offset = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
        if experts <= 1 or not periodic(cfg, "expert", period, offset)[index]:
            return super().make_mlp(index)
        act = cfg.get("hidden_act", "silu")
        return SparseMoE(
            Router(cfg.hidden_size, experts, cfg.get("num_experts_per_tok", 2)),
            FusedExperts(experts, cfg.hidden_size, cfg.get("intermediate_size"), act),
        )

    def sliding_window(self, index: int) -> int | None:
        return None
