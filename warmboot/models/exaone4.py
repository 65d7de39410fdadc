"""EXAONE 4: OLMo 2's post-norm layers with per-head q/k RMSNorm, and hybrid attention:
windowed layers (``layer_types``, else ``sliding_window_pattern``) with rope, the global
layers NoPE when the config has a window."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.olmo2 import PostNormDecoderLayer


class Exaone4ForCausalLM(CausalLM):
    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        d = cfg.head_dim
        # NOTE: transformers rotates every layer when the config has no window, else only the
        # sliding ones (the global layers are NoPE).
        nope = self.window() is not None and not self.is_sliding(index)
        attention = self.attention(
            index,
            q_norm=self.make_norm(d),
            k_norm=self.make_norm(d),
            **(dict(rope=None) if nope else {}),
        )
        return PostNormDecoderLayer(
            attention,
            GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
        )

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def is_sliding(self, index: int) -> bool:
        """``layer_types``, else transformers' default from ``sliding_window_pattern``."""
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is not None:
            return types[index] == "sliding_attention"
        if self.window() is None:  # NOTE: transformers fails here (pattern 0); none slides
            return False
        pattern = cfg.hf.get("sliding_window_pattern", 4)
        if not isinstance(pattern, int) or pattern <= 0:
            raise UnsupportedModelError(
                f"Exaone4: sliding_window_pattern {pattern!r} without layer_types "
                "(transformers cannot build this config either)"
            )
        return (index + 1) % pattern != 0

    def window(self) -> int | None:
        """The config's window (transformers' default when absent; null: none)."""
        return self.cfg.hf.get("sliding_window", 4096)

    def sliding_window(self, index: int) -> int | None:
        return self.window() if self.is_sliding(index) else None
