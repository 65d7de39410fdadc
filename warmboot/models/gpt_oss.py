"""GPT-OSS: Llama's pre-norm layers with attention biases and a learned per-head sink logit
in every softmax (``self_attn.sinks``), sliding and full layers from ``layer_types``, yarn
rope, and sparse MoE blocks: a biased router (top-k of the logits, then a softmax over the
k) and biased experts with a clamped SwiGLU.

The checkpoint stores a layer's experts fused: ``gate_up_proj`` (E, H, 2I) with gate and up
*interleaved* along the last dim, ``down_proj`` (E, I, H), both as ``x @ W``; ``transform``
turns them into ``FusedExperts``' (E, out, in) layout, gate rows before up rows. The MXFP4
release's experts come as codes and scales already (E, out, ...) (``models.quant_formats``):
only gate_up's interleaved rows are split.
"""

from __future__ import annotations

import torch
from torch import nn

from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE, clamped_swiglu
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM

DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' rope for a GPT-OSS config that names none (its theta: 150000)."""


class GptOssForCausalLM(LlamaForCausalLM):
    renames = ((r"^model\.", ""), (r"\.mlp\.router\.", ".mlp.gate."))

    def rope_spec(self, **overrides) -> RopeSpec:
        """The config's rope; transformers' defaults where it names none."""
        cfg = self.cfg
        defaults = dict(theta=cfg.get("rope_theta", 150000.0))
        if cfg.get("rope_parameters") or cfg.get("rope_scaling"):
            return super().rope_spec(**(defaults | overrides))
        limit = dict(max_position_embeddings=cfg.max_position_embeddings)
        return RopeSpec.parse(DEFAULT_ROPE, **(defaults | limit | overrides))

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("attention_bias", True))
        return dict(qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        experts, hidden = cfg.get("num_local_experts"), cfg.hidden_size
        act = clamped_swiglu(cfg.get("swiglu_alpha", 1.702), cfg.get("swiglu_limit", 7.0))
        return SparseMoE(
            Router(
                hidden, experts, cfg.get("num_experts_per_tok"), softmax_after_topk=True, bias=True
            ),
            FusedExperts(experts, hidden, cfg.get("intermediate_size"), bias=True, act_and_mul=act),
        )

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".mlp.experts." not in name:
            return tensor
        leaf = name.rpartition(".")[2]
        if tensor.dtype == torch.uint8 or leaf.endswith("_scale"):  # NOTE: MXFP4 (E, out, .)
            return _deinterleave(tensor, 1) if leaf.startswith("gate_up_proj") else tensor
        if leaf == "gate_up_proj":  # (E, H, 2I) interleaved -> (E, 2I, H), gate rows first
            tensor = _deinterleave(tensor).transpose(1, 2)
        elif leaf == "gate_up_proj_bias":  # (E, 2I) interleaved -> gate, then up
            tensor = _deinterleave(tensor)
        elif leaf == "down_proj":  # (E, I, H) -> (E, H, I)
            tensor = tensor.transpose(1, 2)
        return tensor.contiguous()


def _deinterleave(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``dim`` ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]``."""
    even, odd = t.unflatten(dim, (-1, 2)).unbind(dim + 1 if dim >= 0 else dim)
    return torch.cat((even, odd), dim=dim).contiguous()
