"""Qwen3-Next and Qwen3.5 (dense and MoE): gated DeltaNet layers (``linear_attention``) beside
gated full attention (``full_attention``), as ``layer_types`` lists them (default: every
``full_attention_interval``-th layer attends). Full attention has per-head q/k norms, partial
rotary and a sigmoid output gate (``Attention(output_gate=True)``); every RMSNorm scales by
``1 + w`` but the DeltaNet's gated output norm. The MLP is dense (Qwen3.5) or Qwen2-MoE's
sparse block with a gated shared expert (Qwen3-Next, Qwen3.5-MoE). Qwen3.5's releases
(``Qwen3_5ForConditionalGeneration``, with a vision tower) are served as their language model
(``architectures.TEXT_TOWERS``: text requests; one with an image is refused by the API)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import STACKED, CausalLM, checked_kinds
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.gated_delta import GatedDeltaNet
from warmboot.models.layers.norm import GemmaRMSNorm
from warmboot.models.llama import LlamaForCausalLM
from warmboot.models.qwen_moe import QwenMoeMixin

KINDS = ("linear_attention", "full_attention")


class Qwen3_5ForCausalLM(QwenMoeMixin, LlamaForCausalLM):
    renames = ((r"^model\.", ""), (r"\.linear_attn\.", ".self_attn."))
    stacked = STACKED | {
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }
    ignored = (*CausalLM.ignored, r"^mtp\.")
    """Multi-token-prediction weights (speculative decoding, not served yet)."""
    qk_norm = True

    def layer_types(self) -> list[str]:
        cfg = self.cfg
        types = cfg.get("layer_types")
        if types is None:
            every = cfg.get("full_attention_interval", 4)
            types = [KINDS[(i + 1) % every == 0] for i in range(cfg.num_layers)]
        return checked_kinds(types, cfg.num_layers, KINDS)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return GemmaRMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if self.layer_types()[index] == "full_attention":
            mixer = self.attention(index, **self.attention_options(), output_gate=True)
        else:
            mixer = self.delta_net()
        norm = self.make_norm
        return DecoderLayer(
            mixer, self.make_mlp(index), norm(cfg.hidden_size), norm(cfg.hidden_size)
        )

    def delta_net(self, in_shards: list[int] | None = None) -> GatedDeltaNet:
        cfg = self.cfg
        return GatedDeltaNet(
            cfg.hidden_size,
            cfg.get("linear_num_key_heads"),
            cfg.get("linear_num_value_heads"),
            cfg.get("linear_key_head_dim"),
            cfg.get("linear_value_head_dim"),
            cfg.get("linear_conv_kernel_dim", 4),
            cfg.get("rms_norm_eps", 1e-6),
            in_shards,
        )

    def sliding_window(self, index: int) -> int | None:
        return None


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer sparse, the top-k weights always renormalised."""

    def sparse(self, index: int) -> bool:
        if not self.cfg.get("num_experts"):
            raise UnsupportedModelError("a Qwen3.5-MoE config without num_experts")
        return True

    def renormalize(self) -> bool:
        return True


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next stores the DeltaNet's projections as two tensors, each grouped by key head:
    ``in_proj_qkvz`` (per key head: q, k, then its value heads' v and z) and ``in_proj_ba``."""

    stacked = STACKED | {"in_proj_qkvz": ("in_proj", 0), "in_proj_ba": ("in_proj", 1)}

    def delta_net(self, in_shards: list[int] | None = None) -> GatedDeltaNet:
        cfg = self.cfg
        nk, nv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
        key, value = nk * cfg.get("linear_key_head_dim"), nv * cfg.get("linear_value_head_dim")
        return super().delta_net([2 * key + 2 * value, 2 * nv])

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith("self_attn.in_proj.weight"):
            return tensor
        cfg = self.cfg
        nk, nv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
        dk, dv = cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")
        per = nv // nk  # NOTE: value heads per key head
        qkvz, ba = tensor.split([nk * (2 * dk + 2 * per * dv), 2 * nv])
        q, k, v, z = qkvz.view(nk, -1, tensor.shape[1]).split([dk, dk, per * dv, per * dv], 1)
        b, a = ba.view(nk, 2 * per, tensor.shape[1]).split([per, per], 1)
        return torch.cat([t.reshape(-1, tensor.shape[1]) for t in (q, k, v, z, b, a)])
