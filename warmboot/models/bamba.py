"""Bamba (IBM): Mamba 2 layers (Bamba's mixer, shared with Granite 4) beside Llama attention
layers at ``attn_layer_indices``, each block pre-norm with a gated MLP (``input_layernorm``,
``pre_ff_layernorm``, ``feed_forward``, ``final_layernorm``)."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.granitemoehybrid import ATTENTION, MAMBA, mamba_mixer
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.llama import LlamaForCausalLM


class BambaForCausalLM(LlamaForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"^final_layernorm\.", "norm."),
        (r"\.mamba\.", ".self_attn."),
        (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.", ".mlp."),
    )

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        attn = cfg.get("attn_layer_indices") or []
        if any(not 0 <= i < cfg.num_layers for i in attn):
            raise UnsupportedModelError(f"attn_layer_indices {attn} outside the model's layers")
        return [ATTENTION if i in attn else MAMBA for i in range(cfg.num_layers)]

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == ATTENTION:
            mixer = self.attention(index, **self.attention_options())
        else:
            mixer = mamba_mixer(cfg)
        norm = self.make_norm
        return DecoderLayer(
            mixer, self.make_mlp(index), norm(cfg.hidden_size), norm(cfg.hidden_size)
        )

    def sliding_window(self, index: int) -> int | None:
        return None
