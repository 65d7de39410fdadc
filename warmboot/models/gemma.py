"""Gemma (Google). Gemma 1: Llama with ``1 + w`` RMSNorms, GELU-tanh and embeddings times
sqrt(hidden) (rounded to the model's dtype, as transformers does). Gemma 2: each branch
normed before and after (sandwich), q.k scaled by ``query_pre_attn_scalar ** -0.5``,
attention and final logit soft-caps, sliding and full layers (``layer_types``). Gemma 3
(text): Gemma 2 with per-head q/k norms, no attention soft-cap, and a rope per layer type
(the sliding layers' own theta; scaling on the full layers only)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.attention import Attend, Attention
from warmboot.models.layers.norm import GemmaRMSNorm
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


def _setting(cfg: ModelConfig, key: str, default: Any) -> Any:
    """``config.json``'s ``key`` when present, null included (a null soft-cap is off), else
    transformers' default for the family."""
    return cfg.hf[key] if key in cfg.hf else default


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` holds it (transformers scales by ``tensor(value).to(dtype)``)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype).item()


def _check_servable(cfg: ModelConfig, kv_heads: int) -> None:
    """Refuse what transformers computes otherwise: bidirectional attention, and a missing
    ``head_dim`` or ``num_key_value_heads`` (its defaults are fixed numbers, not derived from
    the heads as the engine's config derives them) where the two disagree."""
    if cfg.get("use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{cfg.architecture} with use_bidirectional_attention (an embedding encoder): "
            "warmboot serves causal attention only"
        )
    derived = {"head_dim": (cfg.head_dim, 256), "num_key_value_heads": (cfg.num_kv_heads, kv_heads)}
    for key, (ours, default) in derived.items():
        if cfg.get(key) is None and ours != default:
            raise UnsupportedModelError(
                f"{cfg.architecture}: config.json lacks {key}; transformers would use its "
                f"default {default}, not the {ours} derived from the attention heads"
            )


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1: Llama's layer with Gemma's norms, activation and embedding scale."""

    activation_key = "hidden_act"
    kv_heads_default = 16
    """transformers' ``num_key_value_heads`` when the config omits it."""

    def __init__(self, cfg: ModelConfig):
        _check_servable(cfg, self.kv_heads_default)
        super().__init__(cfg)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return GemmaRMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act = cfg.get(self.activation_key, "gelu_pytorch_tanh")
        if act == "gelu" and self.activation_key == "hidden_act":
            act = "gelu_pytorch_tanh"  # NOTE: as GemmaConfig: the legacy "gelu" meant tanh
        return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act)

    def layer_type(self, index: int) -> str:
        return FULL

    def sliding_window(self, index: int) -> int | None:
        sliding = self.layer_type(index) == SLIDING
        return _setting(self.cfg, "sliding_window", 4096) if sliding else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * _rounded(self.cfg.hidden_size**0.5, x.dtype)


class SandwichDecoderLayer(nn.Module):
    """Gemma 2/3's layer: ``x + post_attn(attn(input(x)))``, then
    ``x + post_ff(mlp(pre_ff(x)))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norms: list[nn.Module]):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = norms[0], norms[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norms[2], norms[3]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, attend)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma2ForCausalLM(GemmaForCausalLM):
    activation_key = "hidden_activation"
    kv_heads_default = 4
    final_softcap_default: float | None = 30.0

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.final_softcap = _setting(cfg, "final_logit_softcapping", self.final_softcap_default)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        attn = self.attention(index, **self.attention_options())
        norms = [self.make_norm(cfg.hidden_size) for _ in range(4)]
        return SandwichDecoderLayer(attn, self.make_mlp(index), norms)

    def attention(self, index: int, **kwargs) -> Attention:
        scale = _setting(self.cfg, "query_pre_attn_scalar", 256) ** -0.5
        spec = AttentionSpec(scale, self.sliding_window(index), self.attention_softcap())
        return super().attention(index, **(dict(spec=spec) | kwargs))

    def attention_softcap(self) -> float | None:
        return _setting(self.cfg, "attn_logit_softcapping", 50.0)

    def layer_type(self, index: int) -> str:
        """``layer_types``, else transformers' default: every ``pattern``-th layer full."""
        types, pattern = self.cfg.get("layer_types"), self.sliding_pattern()
        if types is not None:
            return types[index]
        return SLIDING if (index + 1) % pattern else FULL

    def sliding_pattern(self) -> int:
        return 2


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    final_softcap_default = None

    def attention_softcap(self) -> float | None:
        return None  # NOTE: transformers' Gemma 3 never applies attn_logit_softcapping

    def sliding_pattern(self) -> int:
        return self.cfg.get("sliding_window_pattern", 6)

    def attention(self, index: int, **kwargs) -> Attention:
        rope = self.shared_rope(self.rope_spec(self.layer_type(index)))
        return super().attention(index, **(dict(rope=rope) | kwargs))

    def rope_spec(self, kind: str = FULL, **overrides) -> RopeSpec:
        """The rope of ``kind`` layers: ``rope_parameters[kind]`` (transformers >= 5), else
        (older configs) the full layers' ``rope_scaling`` and ``rope_theta`` and the sliding
        layers' ``rope_local_base_freq``; transformers' default thetas."""
        cfg = self.cfg
        params = cfg.get("rope_parameters")
        if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
            params = params.get(kind)
        elif kind == FULL:  # NOTE: as transformers 5: a legacy "type" alone leaves it default
            params = {"rope_type": "default", **(cfg.get("rope_scaling") or {})}
        else:
            params = None
        full = kind == FULL
        kwargs = dict(
            theta=cfg.get("rope_theta", 1e6) if full else cfg.get("rope_local_base_freq", 1e4),
            max_position_embeddings=cfg.max_position_embeddings,
            partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
        )
        return RopeSpec.parse(params, **(kwargs | overrides))
