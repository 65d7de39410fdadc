"""LFM3 (Liquid AI): LFM2's gated short convolutions (``conv``) beside attention layers that are
full (``full_attention``) or windowed (``sliding_attention``), as ``layer_types`` lists them.

What changes from LFM2: the attention is Qwen3's (per-head q/k RMSNorms, ``o_proj``) with a
sigmoid gate per head from its own projection ``g_proj`` (``use_attention_gate``); each layer
type has its rope (default: the windowed layers plain, the full ones ``proportional``: the
first ``partial_rotary_factor`` of each half-head's frequencies, over the whole head's
exponents, the rest unrotated), tables and rotation in float32; with ``use_sandwich_norm`` a
norm follows the mixer and the MLP before each residual add; the MLP is ``intermediate_size``
wide as given; the head is tied unless ``tie_word_embeddings`` says not (``tie_embedding`` and
``block_*`` are LFM2's, not read)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import CausalLM, checked_kinds
from warmboot.models.ernie4_5 import Float32RotaryEmbedding
from warmboot.models.glm4 import Glm4DecoderLayer
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.layers.short_conv import ShortConv
from warmboot.models.lfm2 import Lfm2ForCausalLM

KINDS = ("conv", "full_attention", "sliding_attention")
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.5,
    },
}
"""transformers' rope per layer type when the config names none."""


def _default_kind(index: int) -> str:
    if index % 4 == 2:
        return "full_attention"
    return "sliding_attention" if index % 4 == 0 and index > 0 else "conv"


class Lfm3RotaryEmbedding(Float32RotaryEmbedding):
    """Float32 tables and rotation; a ``proportional`` spec rotates the whole head with the
    frequencies past its share set to zero (those dims pass unrotated)."""

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        spec = self.spec
        if spec.rope_type != "proportional":
            return super().build(max_positions, dtype, device)
        d = self.head_dim
        angles = int(spec.get("proportion") * d // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d
        inv_freq = F.pad(1.0 / (spec.theta**exponents), (0, d // 2 - angles))
        inv_freq = inv_freq / spec.get("factor", 1.0)
        self.rows, self.dtype = max_positions, torch.float32
        angles_table = torch.arange(max_positions).float()[:, None] * inv_freq
        cos, sin = self._cos_sin(angles_table, 1.0)
        self.cos, self.sin = cos.to(device), sin.to(device)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    renames = (
        *Lfm2ForCausalLM.renames,
        (r"\.self_attn\.gate_proj\.", ".self_attn.g_proj."),  # NOTE: transformers' save name
        (r"\.post_operator_norm\.", ".post_self_attn_layernorm."),
        (r"\.post_ffn_norm\.", ".post_mlp_layernorm."),
    )
    rope_class = Lfm3RotaryEmbedding

    def __init__(self, cfg: ModelConfig):
        if cfg.hf.get("head_dim") is None:  # NOTE: transformers' default, not hidden / heads
            cfg = dataclasses.replace(cfg, head_dim=128)
        CausalLM.__init__(self, cfg)  # NOTE: not LFM2's (its tie_embedding); tied by default

    def layer_types(self) -> list[str]:
        """``layer_types``, else transformers' default."""
        n = self.cfg.num_layers
        types = self.cfg.get("layer_types")
        if types is None:
            types = [_default_kind(i) for i in range(n)]
        return checked_kinds(types, n, KINDS, "LFM3 ")

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        kind = self.layer_types()[index]
        if kind == "conv":
            bias = bool(cfg.get("conv_bias", False))
            mixer = ShortConv(cfg.hidden_size, cfg.get("conv_L_cache", 7), bias)
        else:
            mixer = self.attention(index, **self.attention_options(), **self.lfm3_attention(kind))
        norms = [self.make_norm(cfg.hidden_size) for _ in range(4)]
        if cfg.get("use_sandwich_norm", True):
            return Glm4DecoderLayer(mixer, self.make_mlp(index), *norms)
        return DecoderLayer(mixer, self.make_mlp(index), *norms[:2])

    def lfm3_attention(self, kind: str) -> dict:
        """The attention options LFM3 adds to LFM2's (q/k norms, biases): its gate and rope."""
        gate = bool(self.cfg.get("use_attention_gate", True))
        return dict(head_gate=gate, rope=self.shared_rope(self.layer_rope(kind)))

    def sliding_window(self, index: int) -> int | None:
        if self.layer_types()[index] != "sliding_attention":
            return None
        window = self.cfg.hf.get("sliding_window", 256)
        if window is None:
            raise UnsupportedModelError("LFM3 sliding_attention layers with sliding_window null")
        return window

    def ffn_size(self) -> int:
        return self.cfg.get("intermediate_size", 7680)

    def layer_rope(self, kind: str) -> RopeSpec:
        """Layer type ``kind``'s rope as transformers resolves it: the default type rotates the
        whole head whatever its ``partial_rotary_factor``; the scaled ones would fail on one."""
        cfg = self.cfg
        ropes = cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_ROPE
        if not isinstance(ropes.get(kind), dict):
            raise UnsupportedModelError(f"LFM3 rope_parameters lack an entry for {kind!r}")
        params = dict(ropes[kind])
        params.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
        partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        kind_ = params.get("rope_type", params.get("type", "default"))
        limit = cfg.max_position_embeddings
        if kind_ == "proportional":
            factor = float(params.get("factor", 1.0))
            extra = (("factor", factor), ("proportion", float(partial)))
            return RopeSpec(float(params["rope_theta"]), kind_, extra, 1.0, limit)
        if kind_ not in (None, "default") and partial != 1.0:
            raise UnsupportedModelError(
                f"LFM3 rope_type {kind_!r} with partial_rotary_factor {partial}"
            )
        return RopeSpec.parse(params, max_position_embeddings=limit)

    def rope_spec(self, **overrides) -> RopeSpec:
        """Not read: every attention layer takes its type's (``layer_rope``)."""
        return RopeSpec(10_000.0)
