"""Rotary position embeddings: every rope type transformers uses for the served families.

A table holds cos and sin for each position up to the engine's ``max_model_len``, so a
position's rotation is one gather. Types: ``default``, ``linear``, ``llama3``, ``yarn``
(with DeepSeek's ``mscale``), ``dynamic`` (NTK) and ``longrope``; partial rotary
(``partial_rotary_factor``: only the first dims rotate) and the interleaved (GPT-J) pairing.

``dynamic`` and ``longrope`` depend on the sequence's length: transformers (and Phi-3's own
code) pick the frequencies of a forward from its largest position, so a prompt longer than
``original_max_position_embeddings`` (longrope) or ``max_position_embeddings`` (dynamic) is
rotated with the long frequencies at every position, a shorter one with the short ones, and
each decode step past the limit with those of its own length. Here a token's rotation is
chosen per request, from ``max(prompt length, position + 1)``: chunked prefill and one
forward agree, and so do a preempted request's recompute and its first pass. For these
types the runner packs the prompt length into the positions' high bits (``pack_position``,
``LENGTH_SHIFT``); positions are read by the rotary embeddings alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")
LENGTH_SHIFT = 32
"""A length-dependent rope's positions carry the request's prompt length from this bit on."""
_POSITION_MASK = (1 << LENGTH_SHIFT) - 1


def pack_position(position: int, prompt_len: int) -> int:
    return position | (prompt_len << LENGTH_SHIFT)


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
            from warmboot.architectures import UnsupportedModelError

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

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT

    def prefix_variant(self, prompt_len: int) -> str | None:
        """What the KV of a request with a ``prompt_len`` prompt depends on besides its tokens
        (a long prompt is rotated by its length), for the prefix cache; None: nothing."""
        if self.rope_type == "longrope":
            long = prompt_len > self.get("original_max_position_embeddings")
            return "longrope:long" if long else None
        if self.rope_type == "dynamic" and prompt_len > self.max_position_embeddings:
            return f"dynamic:{prompt_len}"
        return None


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


def _longrope(spec: RopeSpec, dim: int, lengths: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per row: the short factors for a sequence ``lengths`` long within the original length,
    the long ones past it."""
    orig = spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or spec.max_position_embeddings / orig
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(spec.get("short_factor"), dtype=torch.float32) * spec.theta**shape)
    long = 1.0 / (torch.tensor(spec.get("long_factor"), dtype=torch.float32) * spec.theta**shape)
    return torch.where((lengths > orig)[:, None], long, short), float(attention_factor)


def longrope_rows(spec: RopeSpec, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A longrope table's rows, as (position, sequence length): row ``p`` for a sequence that
    ends there, then rows ``max_positions + p`` for the first original-length positions of a
    sequence longer than the original length (the long factors)."""
    orig = spec.get("original_max_position_embeddings")
    extra = torch.arange(min(orig, max_positions))
    positions = torch.cat((torch.arange(max_positions), extra))
    return positions, torch.cat((torch.arange(max_positions) + 1, torch.full_like(extra, orig + 1)))


def _dynamic(spec: RopeSpec, dim: int, lengths: torch.Tensor) -> torch.Tensor:
    """Per token: the NTK-scaled frequencies of a sequence ``lengths`` long."""
    limit, factor = spec.max_position_embeddings, spec.get("factor")
    seq_len = torch.clamp(lengths, min=limit).double()
    base = spec.theta * ((factor * seq_len / limit) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).float() / dim
    return (1.0 / (base.float()[:, None] ** exponents)).float()  # (P, dim/2)


def frequencies(spec: RopeSpec, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, (dim/2,) or one row per position (P, dim/2), and the factor
    cos and sin are scaled by."""
    kind = spec.rope_type
    if kind == "yarn":
        return _yarn(spec, dim)
    if kind == "longrope":
        return _longrope(spec, dim, positions + 1)
    if kind == "dynamic":
        return _dynamic(spec, dim, positions + 1), 1.0
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
        if self.spec.rope_type == "longrope":
            positions, lengths = longrope_rows(self.spec, max_positions)
            inv_freq, scale = _longrope(self.spec, self.rotary_dim, lengths)
        else:
            inv_freq, scale = frequencies(self.spec, self.rotary_dim, positions)
        self.rows, self.dtype = max_positions, dtype
        self.cos, self.sin = self._cos_sin(positions.float()[:, None] * inv_freq, scale)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def _cos_sin(self, freqs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, rotary_dim / 2) angles -> cos and sin (P, rotary_dim), scaled."""
        if self.spec.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (N, Hq, D), k (N, Hkv, D), positions (N,)."""
        cos, sin = self._rows(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's rotation: a table row, or for a length-dependent type
        the row (longrope) or the frequencies (dynamic) of its request's length."""
        if not self.spec.length_dependent:
            return self.cos[positions], self.sin[positions]
        pos, prompt_len = positions & _POSITION_MASK, positions >> LENGTH_SHIFT
        if self.spec.rope_type == "longrope":
            orig = self.spec.get("original_max_position_embeddings")
            row = torch.where((prompt_len > orig) & (pos < orig), pos + self.rows, pos)
            return self.cos[row], self.sin[row]
        inv_freq = _dynamic(self.spec, self.rotary_dim, torch.maximum(prompt_len, pos + 1))
        return self._cos_sin(pos.float()[:, None] * inv_freq, 1.0)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot = x[..., :rd] if rd < x.shape[-1] else x
        if self.spec.interleaved:
            rotated = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
        else:
            rotated = torch.cat((-rot[..., rd // 2 :], rot[..., : rd // 2]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, x[..., rd:]), dim=-1) if rd < x.shape[-1] else out
