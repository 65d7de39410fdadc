"""ERNIE 4.5 (dense): Llama with ``use_bias`` on every projection, tied embeddings by
default, and the interleaved rope computed in float32 (float32 tables, q/k upcast).

ERNIE 4.5 MoE adds sparse MoE blocks on every ``moe_layer_interval``-th layer from
``moe_layer_start_index`` to ``moe_layer_end_index`` (the others dense): a float32 router
(softmax, the choice biased by ``moe_statics.e_score_correction_bias``, the k weights
renormalised), unbiased experts, ``moe_num_shared_experts`` shared experts as one MLP
(biased with ``use_bias``, added unscaled), and a head biased with ``use_bias``."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.cohere import CohereRotaryEmbedding
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.moe import FusedExperts, Router, SparseMoE
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.llama import LlamaForCausalLM


class Float32RotaryEmbedding(CohereRotaryEmbedding):
    """Tables kept in float32 whatever the model's dtype; q and k rotated in float32."""

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().build(max_positions, torch.float32, device)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    tied_by_default = True
    rope_class = Float32RotaryEmbedding

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-5))

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("use_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "silu"), bool(cfg.get("use_bias", False))
        return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias)

    def rope_spec(self, **overrides) -> RopeSpec:
        theta = self.cfg.get("rope_theta", 500000.0)  # NOTE: transformers' default for ERNIE 4.5
        return super().rope_spec(**(dict(interleaved=True, theta=theta) | overrides))


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.mlp\.(gate\.)?moe_statics\.", ".mlp.gate."),  # NOTE: saved, and as loaded
    )

    def head_bias(self) -> bool:
        return bool(self.cfg.get("use_bias", False))

    def sparse(self, index: int) -> bool:
        cfg = self.cfg
        end = cfg.get("moe_layer_end_index", -1)
        end = cfg.num_layers - 1 if end == -1 else end
        start, every = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_interval", 1)
        return (index + 1) % every == 0 and start <= index <= end

    def make_mlp(self, index: int) -> nn.Module:
        if not self.sparse(index):
            return super().make_mlp(index)
        cfg = self.cfg
        experts, top_k = cfg.get("moe_num_experts", 64), cfg.get("moe_k", 6)
        floor = cfg.get("moe_norm_min", 1e-12)
        if floor >= top_k / experts:  # NOTE: k softmax weights sum to at least k / E
            raise UnsupportedModelError(f"ERNIE 4.5 MoE moe_norm_min {floor}: a floor that bites")
        hidden, act = cfg.hidden_size, cfg.get("hidden_act", "silu")
        size = cfg.get("moe_intermediate_size")
        shared = (cfg.get("moe_num_shared_experts", 2) or 0) * size
        bias = bool(cfg.get("use_bias", False))
        return SparseMoE(
            Router(hidden, experts, top_k, renormalize=True, correction_bias=True, float32=True),
            FusedExperts(experts, hidden, size, act),
            GatedMLP(hidden, shared, act, bias) if shared else None,
        )

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("gate.e_score_correction_bias"):  # NOTE: stored (1, E)
            return tensor.reshape(-1)
        return tensor
