"""MiniMax-M2: Mixtral's layers (no window) with OLMoE's q/k RMSNorms over the whole
projections (before the head split), rope on the first ``rotary_dim`` dims of each head
(``partial_rotary_factor``), and sigmoid routing: the choice biased by the block's
``e_score_correction_bias``, the unbiased top-k weights renormalised."""

from __future__ import annotations

from torch import nn

from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.mixtral import MixtralForCausalLM
from warmboot.models.olmo2 import Olmo2ForCausalLM


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    renames = (
        *MixtralForCausalLM.renames,
        (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    )

    def attention_options(self) -> dict:
        return Olmo2ForCausalLM.attention_options(self, 0)  # q/k norms over the projection

    def sliding_window(self, index: int) -> int | None:
        return None  # NOTE: transformers masks causally only

    def rope_spec(self, **overrides) -> RopeSpec:
        cfg, rotary = self.cfg, self.cfg.get("rotary_dim")
        partial = cfg.get("partial_rotary_factor") or (rotary / cfg.head_dim if rotary else 1.0)
        defaults = dict(theta=cfg.get("rope_theta", 5e6), partial_rotary_factor=partial)
        return super().rope_spec(**(defaults | overrides))

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, hidden = cfg.get("num_local_experts", 256), cfg.hidden_size
        router = Router(
            hidden,
            experts,
            cfg.get("num_experts_per_tok", 8),
            scoring="sigmoid",
            renormalize=True,
            correction_bias=True,
        )
        act = cfg.get("hidden_act", "silu")
        return SparseMoE(router, FusedExperts(experts, hidden, cfg.get("intermediate_size"), act))
