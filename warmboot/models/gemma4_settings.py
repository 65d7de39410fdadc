"""What a Gemma 4 text config implies (``gemma4.py``): its layer types, which layers read
another's K/V, each layer's head shape and the cache's, its ropes and MoE sizes; and what it
asks that is refused."""

from __future__ import annotations

import dataclasses

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.base import checked_kinds
from warmboot.models.gemma import FULL, SLIDING
from warmboot.models.layers.rope import RopeSpec

DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}  # NOTE: transformers' ropes when the config names none
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # NOTE: all transformers reads per layer


@dataclasses.dataclass(frozen=True)
class HeadShape:
    heads: int
    kv_heads: int
    head_dim: int
    cache_heads: int
    cache_dim: int  # NOTE: the cache's K/V heads and width, the widest layer's


def check_servable(cfg: ModelConfig) -> None:
    vocab = cfg.get("vocab_size_per_layer_input", 262_144)
    if cfg.get("hidden_size_per_layer_input", 256) and vocab < cfg.vocab_size:
        raise UnsupportedModelError(  # NOTE: transformers' lookup fails on the ids past it
            f"Gemma 4 vocab_size_per_layer_input {vocab} < vocab_size {cfg.vocab_size}"
        )
    if "sliding_window" in cfg.hf and cfg.hf["sliding_window"] is None:
        raise UnsupportedModelError("Gemma 4 with sliding_window null")
    bidirectional = cfg.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):  # NOTE: "vision": text tokens stay causal
        raise UnsupportedModelError(
            f"Gemma 4 use_bidirectional_attention={bidirectional!r}: warmboot serves causal attention"
        )


def layer_types(cfg: ModelConfig) -> list[str]:
    """``layer_types``, else every sixth layer full; the last layer full (as transformers
    forces it)."""
    n = cfg.num_layers
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types = checked_kinds(list(types), n, (SLIDING, FULL), "Gemma 4 ")
    return [*types[:-1], FULL]


def kv_sources(cfg: ModelConfig, types: list[str]) -> list[int | None]:
    """Per layer: the layer whose K/V it reads (transformers' ``kv_sharing_modes``: the last
    ``num_kv_shared_layers`` read the last earlier layer of their type)."""
    n, shared = cfg.num_layers, cfg.get("num_kv_shared_layers", 0)
    first = n - shared
    if not shared:
        return [None] * n
    if shared < 0 or first <= 0 or set(types[:first]) != set(types):
        raise UnsupportedModelError(
            f"Gemma 4 num_kv_shared_layers {shared}: the first {first} layers must include a "
            f"layer of every type ({sorted(set(types))}) to keep the K/V"
        )
    last = {kind: i for i, kind in enumerate(types[:first])}
    return [None if i < first else last[types[i]] for i in range(n)]


def head_shapes(cfg: ModelConfig, types: list[str], sources) -> list[HeadShape]:
    """Per layer: its heads, K/V heads and head size, and the cache's (the widest's)."""
    overrides = _per_layer_overrides(cfg, types)
    kv_heads, head_dim = cfg.num_kv_heads, cfg.head_dim
    dims = [
        (o.get("num_key_value_heads", kv_heads), o.get("head_dim", head_dim)) for o in overrides
    ]
    if len(set(zip(dims, types, strict=True))) > len(set(types)):  # NOTE: a rope per type
        raise UnsupportedModelError("Gemma 4 per_layer_config: layers of one type differ")
    owners = [d for d, src in zip(dims, sources, strict=True) if src is None]
    cache_heads, cache_dim = max(h for h, _ in owners), max(d for _, d in owners)
    heads = cfg.num_heads
    for kv, dim in dims:
        if heads % cache_heads or cache_heads % kv or not (dim and dim % 2 == 0):
            raise UnsupportedModelError(
                f"Gemma 4: {kv} K/V heads of {dim} beside {cache_heads} K/V heads, {heads} heads"
            )
    return [HeadShape(heads, kv, dim, cache_heads, cache_dim) for kv, dim in dims]


def _per_layer_overrides(cfg: ModelConfig, types: list[str]) -> list[dict]:
    """Per layer, the settings that differ from the global ones: ``per_layer_config`` as
    saved, else (an older config) transformers' derivation for the full layers."""
    if "per_layer_config" in cfg.hf:
        given = cfg.hf["per_layer_config"] or {}
        if not isinstance(given, dict):
            raise UnsupportedModelError("Gemma 4 per_layer_config is not an object")
        found = {}
        for key, value in given.items():
            if not str(key).isdigit() or not isinstance(value, dict):
                raise UnsupportedModelError(f"Gemma 4 per_layer_config entry {key!r}")
            found[int(key)] = value
    else:
        full = {"head_dim": cfg.hf.get("global_head_dim", 512)}
        kv = cfg.hf.get("num_global_key_value_heads")
        if kv is not None and cfg.get("attention_k_eq_v", False):
            full["num_key_value_heads"] = kv
        found = {i: full for i, kind in enumerate(types) if kind == FULL}
    for i, value in found.items():
        unknown = sorted(set(value) - set(_PER_LAYER_KEYS))
        if unknown or i >= cfg.num_layers or None in value.values():
            raise UnsupportedModelError(
                f"Gemma 4 per_layer_config[{i}] sets {unknown or value}: served per layer: "
                f"{', '.join(_PER_LAYER_KEYS)} (not null) of layers 0..{cfg.num_layers - 1}"
            )
    return [found.get(i, {}) for i in range(cfg.num_layers)]


def rope_spec(cfg: ModelConfig, kind: str) -> RopeSpec:
    """Layer type ``kind``'s rope: ``default`` (the whole head at ``rope_theta``; transformers
    reads nothing else) or ``proportional``."""
    ropes = cfg.get("rope_parameters") or DEFAULT_ROPE
    params = ropes.get(kind) if isinstance(ropes, dict) else None
    if not isinstance(params, dict) or params.get("rope_theta") is None:
        raise UnsupportedModelError(f"Gemma 4 rope_parameters lack a rope_theta for {kind!r}")
    rope_type, theta = params.get("rope_type", "default"), float(params["rope_theta"])
    limit = cfg.max_position_embeddings
    if rope_type == "default":
        return RopeSpec(theta, max_position_embeddings=limit)
    if rope_type == "proportional":
        proportion = float(params.get("partial_rotary_factor", 1.0))
        extra = (("factor", float(params.get("factor", 1.0))), ("proportion", proportion))
        return RopeSpec(theta, "proportional", extra, 1.0, limit)
    raise UnsupportedModelError(
        f"Gemma 4 rope_type {rope_type!r} on {kind} layers; served: default, proportional"
    )


def moe_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    sizes = [cfg.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")]
    if any(not isinstance(s, int) or s < 1 for s in sizes) or sizes[1] > sizes[0]:
        names = "num_experts, top_k_experts, moe_intermediate_size"
        raise UnsupportedModelError(f"Gemma 4 enable_moe_block with {names} {sizes}")
    return sizes[0], sizes[1], sizes[2]
