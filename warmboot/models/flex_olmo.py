"""FlexOlmo: OLMo 2's post-sublayer norms and whole-projection q/k norms over OLMoE's sparse
MoE blocks (softmax then top-k, renormalised when ``norm_topk_prob``)."""

from __future__ import annotations

from warmboot.models.olmo2 import Olmo2ForCausalLM
from warmboot.models.olmoe import OlmoeForCausalLM


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    make_mlp = OlmoeForCausalLM.make_mlp
