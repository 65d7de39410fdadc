"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama with q/k/v and gate/up already fused in the
checkpoint (loaded as they are into the stacked projections) and longrope, whose
``original_max_position_embeddings`` is the config's top-level field."""

from __future__ import annotations

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM

LONGROPE_ALIASES = ("su", "yarn")
"""Older Phi-3 configs' names for longrope (transformers' ``Phi3Config`` reads them so)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    def rope_spec(self, **overrides) -> RopeSpec:
        cfg = self.cfg
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = params.pop("rope_type", params.pop("type", None)) or "default"
        params["rope_type"] = kind = "longrope" if kind in LONGROPE_ALIASES else kind
        if kind not in ("default", "longrope"):  # NOTE: as transformers' Phi3Config
            raise UnsupportedModelError(f"Phi-3 with rope_type {kind!r}: default or longrope only")
        if kind == "longrope":  # NOTE: transformers: the top-level field wins
            params["original_max_position_embeddings"] = cfg.get(
                "original_max_position_embeddings", 4096
            )
        kwargs = dict(
            theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.max_position_embeddings,
            partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
        )
        return RopeSpec.parse(params, **(kwargs | overrides))
