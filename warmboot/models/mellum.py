"""Mellum (JetBrains): Qwen3-MoE's attention (per-head q/k RMSNorm) and routing (softmax,
top-k, renormalised with ``norm_topk_prob``), with windows on the ``sliding_attention``
layers, a rope per layer type (``rope_parameters`` keyed by layer type) and each layer's
MLP dense or sparse by ``mlp_layer_types``. Its multi-token-prediction layer (``mtp.``) is
not read."""

from __future__ import annotations

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import CausalLM
from warmboot.models.layers.attention import Attention
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.qwen_moe import Qwen3MoeForCausalLM

DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
"""``MellumConfig``'s ropes where config.json names none."""


class MellumForCausalLM(Qwen3MoeForCausalLM):
    ignored = (*CausalLM.ignored, r"^mtp\.")

    def attention(self, index: int, **kwargs) -> Attention:
        rope = self.shared_rope(self.rope_spec(self.layer_type(index)))
        return super().attention(index, **(dict(rope=rope) | kwargs))

    def rope_spec(self, layer_type: str | None = None, **overrides) -> RopeSpec:
        """The rope of ``layer_type``'s ``rope_parameters`` (whole heads only); by default the
        first layer's."""
        layer_type = layer_type or self.layer_type(0)
        params = (self.cfg.get("rope_parameters") or DEFAULT_ROPE).get(layer_type)
        if not isinstance(params, dict) or params.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(
                f"Mellum rope_parameters[{layer_type!r}]: {params!r} (a full rope per layer type)"
            )
        kwargs = dict(max_position_embeddings=self.cfg.max_position_embeddings) | overrides
        return RopeSpec.parse(params, **kwargs)

    def layer_type(self, index: int) -> str:
        types = self.cfg.get("layer_types")
        return "full_attention" if types is None else types[index]

    def sliding_window(self, index: int) -> int | None:
        sliding = self.layer_type(index) == "sliding_attention"
        return self.cfg.hf.get("sliding_window", 1024) if sliding else None

    def sparse(self, index: int) -> bool:
        types = self.cfg.get("mlp_layer_types")
        return types is None or types[index] == "sparse"
