"""Rotary position embeddings: every rope type transformers uses for the served families.

A table holds cos and sin for each position up to the engine's ``max_model_len``, so a
position's rotation is one gather. Types: ``default``, ``linear``, ``llama3``, ``yarn``
(with DeepSeek's ``mscale``), ``dynamic`` (NTK) and ``longrope``; partial rotary
(``partial_rotary_factor``: only the first dims rotate) and the interleaved (GPT-J) pairing.

NOTE: ``dynamic`` and ``longrope`` depend on the sequence length in transformers (it picks
the frequencies from the largest position of each forward call). Here row ``p`` uses the
frequencies transformers uses when position ``p`` is the last one: identical in decode and
for prompts within ``original_max_position_embeddings``; a prompt that crosses it is
rotated per position, where transformers would rotate all its positions as the longest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()
    """The checkpoint's rope parameters (factor, original_max_position_embeddings, ...)."""
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    interleaved: bool = False

    @classmethod
    def parse(
        cls,
        params: Mapping[str, Any] | None,
        *,
        theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        partial_rotary_factor: float = 1.0,
        interleaved: bool = False,
    ) -> RopeSpec:
        """``params``: a config's ``rope_parameters`` (transformers >= 5) or ``rope_scaling``."""
        params = dict(params or {})
        rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            from warmboot.models.registry import UnsupportedModelError

            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        theta = float(params.pop("rope_theta", theta))
        partial = float(params.pop("partial_rotary_factor", partial_rotary_factor))
        items = tuple(sorted((k, _freeze(v)) for k, v in params.items()))
        return cls(theta, rope_type, items, partial, max_position_embeddings, interleaved)

    def get(self, name: str, default: Any = None) -> Any:
        value = dict(self.params).get(name, default)
        return default if value is None else value

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, old_len = spec.get("factor"), spec.get("original_max_position_embeddings")
    low, high = spec.get("low_freq_factor", 1.0), spec.get("high_freq_factor", 4.0)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    base, orig = spec.theta, spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or spec.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.get("beta_fast", 32)), correction_dim(spec.get("beta_slow", 1))
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(spec: RopeSpec, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    orig = spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or spec.max_position_embeddings / orig
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(spec.get("short_factor"), dtype=torch.float32) * spec.theta**shape)
    long = 1.0 / (torch.tensor(spec.get("long_factor"), dtype=torch.float32) * spec.theta**shape)
    per_row = torch.where((positions + 1 > orig)[:, None], long, short)  # (P, dim/2)
    return per_row, float(attention_factor)


def _dynamic(spec: RopeSpec, dim: int, positions: torch.Tensor) -> torch.Tensor:
    limit, factor = spec.max_position_embeddings, spec.get("factor")
    seq_len = torch.clamp(positions + 1, min=limit).double()
    base = spec.theta * ((factor * seq_len / limit) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / (base.float()[:, None] ** exponents)).float()  # (P, dim/2)


def frequencies(spec: RopeSpec, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, (dim/2,) or one row per position (P, dim/2), and the factor
    cos and sin are scaled by."""
    kind = spec.rope_type
    if kind == "yarn":
        return _yarn(spec, dim)
    if kind == "longrope":
        return _longrope(spec, dim, positions)
    if kind == "dynamic":
        return _dynamic(spec, dim, positions), 1.0
    inv_freq = _base_inv_freq(spec.theta, dim)
    if kind == "linear":
        return inv_freq / spec.get("factor"), 1.0
    if kind == "llama3":
        return _llama3(spec, inv_freq), 1.0
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of q and k by their positions' angles.
    The tables are built by ``build`` once the engine's ``max_model_len`` is known."""

    def __init__(self, spec: RopeSpec, head_dim: int):
        super().__init__()
        self.spec, self.head_dim = spec, head_dim
        self.rotary_dim = spec.rotary_dim(head_dim)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions)
        inv_freq, scale = frequencies(self.spec, self.rotary_dim, positions)
        freqs = positions.float()[:, None] * inv_freq  # (P, rotary_dim / 2)
        if self.spec.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (N, Hq, D), k (N, Hkv, D), positions (N,)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot = x[..., :rd] if rd < x.shape[-1] else x
        if self.spec.interleaved:
            rotated = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
        else:
            rotated = torch.cat((-rot[..., rd // 2 :], rot[..., : rd // 2]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, x[..., rd:]), dim=-1) if rd < x.shape[-1] else out
