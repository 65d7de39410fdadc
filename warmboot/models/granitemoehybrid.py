"""Granite 4 (``granitemoehybrid``, IBM): Mamba 2 layers beside attention layers, as
``layer_types`` (``layers_block_type``) lists them (legacy names ``mamba`` / ``attention``
accepted), over Granite-MoE-Shared's blocks: routed experts (top-k, then a softmax over the
k) plus a shared MLP, or the shared MLP alone without experts. Granite's multipliers on the
embeddings, the residual branches, the attention scores and the logits. Attention rotates
by rope only with ``position_embedding_type: rope`` (else NoPE)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.base import checked_kinds
from warmboot.models.granite import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.mamba2 import Mamba2Mixer

MAMBA, ATTENTION = "linear_attention", "full_attention"
LEGACY = {"mamba": MAMBA, "attention": ATTENTION}
"""transformers' remap of older layer type names."""


def hybrid_layer_types(cfg, default: str = MAMBA) -> list[str]:
    """Per layer ``linear_attention`` (Mamba 2) or ``full_attention``, from ``layer_types``
    or ``layers_block_type`` (every layer ``default`` when neither is given)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or [default] * cfg.num_layers
    types = [LEGACY.get(t, t) for t in types]
    return checked_kinds(types, cfg.num_layers, (MAMBA, ATTENTION))


def mamba_mixer(cfg, inner: int | None = None, **overrides) -> Mamba2Mixer:
    """Bamba's Mamba 2 mixer (Granite 4, Bamba, Falcon-H1) from the ``mamba_*`` settings,
    ``inner`` channels wide (default ``mamba_expand`` x hidden); its conv runs the model's
    ``hidden_act``."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"a Mamba conv activation {act!r} is not served (silu only)")
    heads, hidden = cfg.get("mamba_n_heads", 128), cfg.hidden_size
    inner = inner or int(cfg.get("mamba_expand", 2) * hidden)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inner:
        raise UnsupportedModelError(
            f"mamba_n_heads x mamba_d_head != {inner} (mamba_expand x hidden)"
        )
    bias = bool(cfg.get("mamba_proj_bias", False))
    options = dict(
        num_heads=heads,
        head_dim=head_dim,
        n_groups=cfg.get("mamba_n_groups", 1),
        d_state=cfg.get("mamba_d_state", 256),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        chunk_size=cfg.get("mamba_chunk_size", 256),
        eps=cfg.get("rms_norm_eps", 1e-6),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        in_bias=bias,
        out_bias=bias,
        dt_limit=cfg.get("time_step_limit"),
    )
    return Mamba2Mixer(hidden, **(options | overrides))


class SharedMLPOnly(nn.Module):
    """A block without experts: the shared MLP alone (named as in ``SparseMoE``)."""

    def __init__(self, shared_expert: nn.Module):
        super().__init__()
        self.shared_expert = shared_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    renames = (*GraniteMoeForCausalLM.renames, (r"\.mamba\.", ".self_attn."))

    def layer_types(self) -> list[str]:
        return hybrid_layer_types(self.cfg)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == ATTENTION:
            spec = AttentionSpec(scale=cfg.get("attention_multiplier", 1.0))
            rope = None
            if cfg.get("position_embedding_type") == "rope":
                rope = self.shared_rope(self.rope_spec())
            mixer = self.attention(index, spec=spec, rope=rope, **self.attention_options())
        else:
            mixer = mamba_mixer(cfg)
        return DecoderLayer(
            mixer,
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
            residual_scale=cfg.get("residual_multiplier", 1.0),
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        if cfg.get("num_local_experts", 0) > 0:
            return super().make_mlp(index)
        act = cfg.get("hidden_act", "silu")
        return SharedMLPOnly(GatedMLP(cfg.hidden_size, cfg.get("shared_intermediate_size"), act))

    def sliding_window(self, index: int) -> int | None:
        return None
