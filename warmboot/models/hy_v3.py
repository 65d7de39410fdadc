"""Hy3 (Tencent HunYuan V3): Llama with per-head q/k RMSNorms (before the rope) and each
layer's MLP dense or sparse by ``mlp_layer_types`` (default: the first dense). The sparse
block: a float32 sigmoid router whose choice is biased by the block's
``e_score_correction_bias``, the unbiased top-k weights renormalised and times
``router_scaling_factor``, plus ``num_shared_experts`` always-on experts as one gated MLP
(``mlp_bias``), added unscaled (``enable_moe_fp32_combine``'s float32 sum of two tensors
rounds once, as the plain sum does). Checkpoints name the router ``router.gate``, its bias
``expert_bias`` and the shared experts ``shared_mlp``; the multi-token-prediction layers are
not read."""

from __future__ import annotations

import re

from torch import nn

from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class HYV3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    renames = (
        *LlamaForCausalLM.renames,
        (r"\.mlp\.router\.gate\.", ".mlp.gate."),
        (r"\.mlp\.(expert_bias|e_score_correction_bias)$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.shared_(mlp|experts)\.", ".mlp.shared_expert."),
    )

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * cfg.num_layers
        if types[index] != "sparse":
            return super().make_mlp(index)
        hidden, act, bias = cfg.hidden_size, cfg.get("hidden_act", "silu"), cfg.get("mlp_bias")
        experts, size = cfg.get("num_experts"), cfg.get("moe_intermediate_size")
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=True,
            scale=float(cfg.get("router_scaling_factor", 2.826)),
            correction_bias=True,
            float32=True,
        )
        shared = size * (cfg.get("num_shared_experts") or 0)
        return SparseMoE(
            router,
            FusedExperts(experts, hidden, size, act),
            GatedMLP(hidden, shared, act, bool(bias)) if shared else None,
        )

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        layer = _LAYER.match(name)
        if layer and int(layer[1]) >= self.cfg.num_layers:
            return None  # NOTE: multi-token-prediction layers, unused in decoding
        return super().map_name(name)
