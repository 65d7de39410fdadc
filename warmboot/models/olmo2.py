"""OLMo 2 and OLMo 3: norms after the sublayers (``x + norm(attn(x))``, ``x + norm(mlp(x))``,
no input norms), q/k RMSNorm over the whole projection before the head split. OLMo 3 adds
sliding windows per ``layer_types`` and a rope per layer type."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import CausalLM
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec


class Olmo2RMSNorm(RMSNorm):
    """OLMo 2's RMSNorm: normalised and scaled by ``weight`` in float32, then cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class PostNormDecoderLayer(nn.Module):
    """``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``."""

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        post_attention_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.post_attention_layernorm = post_attention_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, attend))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(CausalLM):
    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return Olmo2RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        return PostNormDecoderLayer(
            self.attention(index, **self.attention_options(index)),
            self.make_mlp(index),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
        )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return GatedMLP(
            cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act", "silu")
        )

    def attention_options(self, index: int) -> dict:
        cfg, bias = self.cfg, bool(self.cfg.get("attention_bias", False))
        return dict(
            qkv_bias=bias,
            o_bias=bias,
            q_norm=self.make_norm(cfg.q_size),
            k_norm=self.make_norm(cfg.kv_size),
            norm_before_split=True,
        )


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2 with windows on the ``sliding_attention`` layers and a rope per layer type."""

    def attention_options(self, index: int) -> dict:
        rope = self.shared_rope(self.rope_spec(self.layer_types()[index]))
        return super().attention_options(index) | dict(rope=rope)

    def rope_spec(self, layer_type: str = "full_attention", **overrides) -> RopeSpec:
        kwargs = dict(max_position_embeddings=self.cfg.max_position_embeddings) | overrides
        return RopeSpec.parse(olmo3_rope_parameters(self.cfg, layer_type), **kwargs)

    def layer_types(self) -> list[str]:
        """``layer_types``, else transformers' default: every fourth layer full attention."""
        n = self.cfg.num_layers
        default = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]
        return self.cfg.get("layer_types") or default

    def sliding_window(self, index: int) -> int | None:
        sliding = self.layer_types()[index] == "sliding_attention"
        return self.cfg.hf.get("sliding_window", 4096) if sliding else None


def olmo3_rope_parameters(cfg: ModelConfig, layer_type: str) -> dict:
    """Layer type -> its rope parameters, as transformers' ``Olmo3Config`` reads them."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params.get(layer_type), dict):
            raise UnsupportedModelError(f"Olmo3 rope_parameters lack {layer_type!r}")
        return params[layer_type]
    # NOTE: a flat (older) config: transformers gives rope_scaling and rope_theta to the full
    # attention layers only; the sliding ones get the default rope and theta.
    if layer_type == "full_attention":
        theta = cfg.get("rope_theta", 500000.0)
        return {"rope_theta": theta, **(cfg.get("rope_scaling") or {})}
    return dict(rope_type="default", rope_theta=500000.0)
