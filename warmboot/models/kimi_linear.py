"""Kimi Linear (Moonshot AI): Kimi Delta Attention state layers (``layers.kda``,
``linear_attention``) beside multi-head latent attention (``full_attention``) over pre-norm
blocks whose MLP is dense or DeepSeek-V3's MoE.

- Layer kinds: ``layer_types``, else ``linear_attn_config``'s 1-based ``full_attn_layers`` /
  ``kda_layers``, else every 4th layer from layer 4 (index 4, 8, ...) attends; MLPs:
  ``mlp_layer_types``, else dense below ``first_k_dense_replace`` (default 1). This is how
  transformers 5.23 reads the config, and its precedence; ``linear_attn_config``'s
  ``num_heads`` / ``head_dim`` / ``short_conv_kernel_size`` win over ``linear_*``.
- The latent attention is DeepSeek's without rope (NoPE: ``mla_use_nope``): the ``k_pe``
  part is kept in the latent cache unrotated, the softmax scale is ``qk_head_dim ** -0.5``.
- The MoE is DeepSeek-V3's (sigmoid, correction bias, groups scored by their best two,
  shared experts); Moonshot's config names it differently (``num_experts``,
  ``num_experts_per_token``, ``moe_renormalize``, ...): ``as_deepseek`` maps the names and
  transformers' defaults onto DeepSeek's, and a config giving one setting two values is refused.

Refused: ``mla_use_nope: false`` (transformers applies no rope, Moonshot's code would), fewer
KV heads than heads (transformers' attention breaks), a router other than sigmoid, ungrouped
routing over several groups, activations other than SiLU (the KDA convs' too).
"""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from warmboot.config import ModelConfig
from warmboot.kernels.backend import KVLayout
from warmboot.models.base import EXPERT_PROJECTIONS, checked_kinds
from warmboot.models.deepseek import DeepseekV3ForCausalLM, _refuser
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.kda import IN_SHARDS, KimiDeltaAttention
from warmboot.models.layers.state import QKV_CONVS

LINEAR, FULL = "linear_attention", "full_attention"
MLP_KINDS = ("dense", "sparse")
LINEAR_SIZES = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")
_KDA_WEIGHT = re.compile(r"^layers\.(\d+)\.self_attn\.(\w+)\.weight$")

SETTINGS: dict[str, tuple[tuple[str, ...], Any]] = {
    # DeepSeek's name: (the names a Kimi config may use, transformers' default)
    "n_routed_experts": (("num_experts", "num_local_experts", "n_routed_experts"), 256),
    "num_experts_per_tok": (("num_experts_per_token", "num_experts_per_tok"), 8),
    "n_shared_experts": (("num_shared_experts", "n_shared_experts"), 1),
    "norm_topk_prob": (("moe_renormalize", "norm_topk_prob"), True),
    "n_group": (("num_expert_group", "n_group"), 1),
    "topk_group": (("topk_group",), 1),
    "routed_scaling_factor": (("routed_scaling_factor",), 2.446),
    "scoring_func": (("moe_router_activation_func", "scoring_func"), "sigmoid"),
    "kv_lora_rank": (("kv_lora_rank",), 512),
    "qk_rope_head_dim": (("qk_rope_head_dim",), 64),
    "qk_nope_head_dim": (("qk_nope_head_dim",), 128),
    "v_head_dim": (("v_head_dim",), 128),
    "moe_intermediate_size": (("moe_intermediate_size",), 1024),
    "intermediate_size": (("intermediate_size",), 9216),
    "rms_norm_eps": (("rms_norm_eps",), 1e-5),
    "hidden_act": (("hidden_act",), "silu"),
}
LINEAR_SETTINGS = {
    # ours: (linear_attn_config's name, the top-level name, transformers' default)
    "linear_num_heads": ("num_heads", "linear_num_heads", 32),
    "linear_head_dim": ("head_dim", "linear_head_dim", 128),
    "linear_conv_kernel_dim": ("short_conv_kernel_size", "linear_conv_kernel_dim", 4),
}


def as_deepseek(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A Kimi Linear config under DeepSeek-V3's names, with transformers' defaults, its
    ``layer_types`` and ``mlp_layer_types`` spelled out and the linear-attention sizes."""
    refuse = _refuser("KimiLinearForCausalLM")
    out = renamed_settings(hf, SETTINGS, refuse)
    lin = hf.get("linear_attn_config") or {}
    for ours, (inner, top, default) in LINEAR_SETTINGS.items():
        out[ours] = lin.get(inner, hf.get(top) if hf.get(top) is not None else default)
    out["layer_types"] = hf.get("layer_types") or _layer_types(lin, num_layers, refuse)
    dense = hf.get("first_k_dense_replace", 1)
    mlp = hf.get("mlp_layer_types") or [MLP_KINDS[i >= dense] for i in range(num_layers)]
    out["mlp_layer_types"] = mlp
    # DeepSeek's code reads these: every layer's MLP kind is listed, routing is V3's
    return out | dict(first_k_dense_replace=0, topk_method="noaux_tc", mlp_bias=False)


def renamed_settings(hf: dict[str, Any], settings: dict, refuse) -> dict[str, Any]:
    """``hf`` with each of ``settings``' DeepSeek names (``ours: (names, default)``) set from
    the names a config gives (refused where two disagree), else transformers' default."""
    out = dict(hf)
    for ours, (names, default) in settings.items():
        given = {n: hf[n] for n in names if hf.get(n) is not None}
        if len(set(map(repr, given.values()))) > 1:
            refuse(f"settings that disagree: {given}")
        out[ours] = next(iter(given.values()), default)
    return out


def _layer_types(lin: dict, num_layers: int, refuse) -> list[str]:
    if "full_attn_layers" not in lin or "kda_layers" not in lin:
        return [FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers)]
    types: list[str | None] = [None] * num_layers
    for kind, listed in ((FULL, lin["full_attn_layers"]), (LINEAR, lin["kda_layers"])):
        for n in listed:
            if not 1 <= n <= num_layers:
                refuse(f"linear_attn_config layer {n} (1-based, {num_layers} layers)")
            types[n - 1] = kind
    return types


class NoRope(nn.Module):
    """Leaves q and k as they are: latent attention without positions (NoPE)."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


class KdaHybrid(DeepseekV3ForCausalLM):
    """DeepSeek-V3's blocks with Kimi-delta-attention state layers where ``layer_types`` says
    ``linear_attention`` and dense MLPs where ``mlp_layer_types`` says ``dense`` (Kimi Linear,
    Ling's hybrid): a family gives its mixer (``kda_mixer``) and the checkpoint projections
    it stacks into the mixer's ``in_proj`` (``in_shards``)."""

    in_shards: tuple[str, ...] = ()

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        refuse = _refuser(cfg.architecture)
        super().check(cfg)
        if cfg.get("hidden_act") != "silu":
            refuse(f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
        checked_kinds(cfg.get("layer_types"), cfg.num_layers, (LINEAR, FULL))
        mlp = cfg.get("mlp_layer_types")
        if len(mlp) != cfg.num_layers or not set(mlp) <= set(MLP_KINDS):
            refuse(f"mlp_layer_types {mlp} ({cfg.num_layers} of {', '.join(MLP_KINDS)})")
        sizes = [cfg.get(name) for name in LINEAR_SIZES]
        if not all(isinstance(s, int) and s > 0 for s in sizes):
            refuse(f"linear attention heads / head dim / conv kernel {sizes}")

    # -- composition ----------------------------------------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if cfg.get("layer_types")[index] == FULL:
            return super().make_layer(index)
        size = cfg.hidden_size
        mixer = self.kda_mixer()
        return DecoderLayer(mixer, self.make_mlp(index), self.make_norm(size), self.make_norm(size))

    def kda_mixer(self) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        if cfg.get("mlp_layer_types")[index] == "dense":
            return GatedMLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act"))
        return super().make_mlp(index)  # NOTE: first_k_dense_replace is 0 here: sparse

    # -- facts and names ------------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        """The latent cache of the attention layers (``MLAttention.kv_layout``) and the KDA
        layers' states."""
        cfg = self.cfg
        return self.with_states(
            KVLayout(1, 1, cfg.get("kv_lora_rank") + cfg.get("qk_rope_head_dim"))
        )

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """DeepSeek's names, and a KDA layer's six input projections into its ``in_proj``."""
        mapped = super().map_name(name)
        if mapped is None or mapped[1] is not None:
            return mapped
        found = _KDA_WEIGHT.match(mapped[0])
        shards = self.in_shards
        if found and found[2] in shards and self.cfg.get("layer_types")[int(found[1])] == LINEAR:
            return f"layers.{found[1]}.self_attn.in_proj.weight", shards.index(found[2])
        return mapped

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``A_log``: one per head, however a checkpoint shapes it ((1, 1, H, 1) by Moonshot
        and transformers)."""
        return tensor.reshape(-1) if name.endswith(".self_attn.A_log") else tensor


class KimiLinearForCausalLM(KdaHybrid):
    renames = (
        (r"^model\.", ""),
        (r"\.block_sparse_moe\.", ".mlp."),  # NOTE: Moonshot's name of the sparse MLP
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        (r"\.self_attn\.forget_gate\.", ".self_attn."),  # NOTE: transformers' module
    )
    in_shards = IN_SHARDS
    stacked = DeepseekV3ForCausalLM.stacked | {c: ("conv1d", i) for i, c in enumerate(QKV_CONVS)}
    expert_projections = EXPERT_PROJECTIONS | {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
    }

    def __init__(self, cfg: ModelConfig):
        hf = MappingProxyType(as_deepseek(dict(cfg.hf), cfg.num_layers))
        super().__init__(dataclasses.replace(cfg, hf=hf))

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        refuse = _refuser(cfg.architecture)
        super().check(cfg)
        if cfg.get("mla_use_nope") is False:
            refuse("mla_use_nope: false (transformers applies no rope, Moonshot's code does)")
        if cfg.num_kv_heads != cfg.num_heads:
            refuse(f"num_key_value_heads {cfg.num_kv_heads} != {cfg.num_heads} heads")
        if cfg.get("n_group") > 1 and cfg.get("use_grouped_topk") is False:
            refuse("use_grouped_topk: false over several groups (transformers groups anyway)")

    def kda_mixer(self) -> nn.Module:
        cfg = self.cfg
        return KimiDeltaAttention(
            cfg.hidden_size,
            cfg.get("linear_num_heads"),
            cfg.get("linear_head_dim"),
            cfg.get("linear_conv_kernel_dim"),
            cfg.get("rms_norm_eps"),
        )

    def latent_rope(self, spec, dim: int) -> nn.Module:
        return NoRope()  # NOTE: Kimi's latent attention has no rope (mla_use_nope)

    def softmax_scale(self, qk_head_dim: int) -> float:
        return qk_head_dim**-0.5
