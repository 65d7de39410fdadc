"""Granite SWA (IBM): Granite's multipliers, with a learned per-head attention sink in every
softmax (``self_attn.sinks``), windows on the ``sliding_attention`` layers (default: every
fourth layer from the first is full attention) and a rope base per layer
(``layer_rope_theta``; 0: a NoPE layer); the head tied by default."""

from __future__ import annotations

from torch import nn

from warmboot.kernels.backend import AttentionSpec
from warmboot.models.granite import GraniteForCausalLM
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.rope import RopeSpec, RotaryEmbedding


class GraniteSWAForCausalLM(GraniteForCausalLM):
    tied_by_default = True

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        scale = cfg.get("attention_multiplier", cfg.head_dim**-0.5)
        spec = AttentionSpec(scale=scale, sliding_window=self.sliding_window(index))
        return DecoderLayer(
            self.attention(
                index, spec=spec, rope=self.layer_rope(index), **self.attention_options()
            ),
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
            residual_scale=cfg.get("residual_multiplier", 1.0),
        )

    def attention_options(self) -> dict:
        return super().attention_options() | dict(sinks=True)

    def layer_rope(self, index: int) -> RotaryEmbedding | None:
        """The rope of the config's parameters with the layer's base; None for base 0."""
        cfg = self.cfg
        thetas = cfg.get("layer_rope_theta")
        if thetas is None:
            return self.shared_rope(self.rope_spec())
        if not thetas[index]:
            return None
        params = dict(cfg.get("rope_parameters") or {}) | {"rope_theta": thetas[index]}
        limit = cfg.max_position_embeddings
        return self.shared_rope(RopeSpec.parse(params, max_position_embeddings=limit))

    def sliding_window(self, index: int) -> int | None:
        types = self.cfg.get("layer_types")
        sliding = index % 4 != 0 if types is None else types[index] == "sliding_attention"
        return self.cfg.hf.get("sliding_window", 128) if sliding else None
