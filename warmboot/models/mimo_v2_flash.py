"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): DeepSeek-V3's routing (sigmoid in float32,
``e_score_correction_bias``, groups, renormalised, scaled) without shared experts, MLPs per
``mlp_layer_types``, over GQA attention with a rope per layer type (base and partial rotary
from ``rope_parameters[layer_type]``), values narrower than keys (``v_head_dim``) and scaled
by ``attention_value_scale``, and ``sliding_attention`` layers that have twice the KV heads
and a learned sink per head.

The paged cache holds one head count and width for every layer, so it is laid out for the
widest: each layer keeps twice ``num_key_value_heads`` heads of ``head_dim``. The full layers'
K/V heads are stored twice (each query head still reads its own), values are padded with zero
dims that ``o_proj`` (zero columns) ignores, and the value scale is folded into ``v_proj``:
exact, at the cost of a cache 2 * head_dim / (head_dim + v_head_dim) times transformers' on
the windowed layers, twice that on the full ones. Its multi-token-prediction tensors are not
read."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionSpec, KVLayout
from warmboot.models.base import STACKED
from warmboot.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from warmboot.models.layers.attention import Attention
from warmboot.models.layers.rope import RopeSpec

_LAYER = re.compile(r"^layers\.(\d+)\.self_attn\.(qkv_proj|o_proj)\.(weight|bias)$")


class MiMoV2FlashForCausalLM(Glm4MoeLiteForCausalLM):
    renames = ((r"^model\.", ""), (r"\.self_attn\.attention_sink_bias$", ".self_attn.sinks"))
    stacked = STACKED
    ignored = (r"rotary_emb\.inv_freq$", r"^model\.mtp\.")
    defaults = dict(routed_scaling_factor=1.0, norm_topk_prob=True)

    def __init__(self, cfg: ModelConfig):
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        if heads % (2 * kv) or cfg.get("v_head_dim", cfg.head_dim) > cfg.head_dim:
            raise UnsupportedModelError(f"{cfg.architecture}: {heads} heads over 2 x {kv}")
        super().__init__(cfg)

    @classmethod
    def check_attention(cls, cfg: ModelConfig, refuse) -> None:
        pass  # NOTE: GQA: the checks in ``__init__``

    def swa(self, index: int) -> bool:
        types = self.cfg.get("layer_types") or []
        return types[index] == "sliding_attention" if types else index % 6 not in (0, 5)

    def make_attention(self, index: int) -> nn.Module:
        cfg, d = self.cfg, self.cfg.head_dim
        kind = "sliding_attention" if self.swa(index) else "full_attention"
        params = dict((cfg.get("rope_parameters") or {}).get(kind) or {})
        params.setdefault("partial_rotary_factor", 0.334)
        rope = RopeSpec.parse(params, max_position_embeddings=cfg.max_position_embeddings)
        window = self.sliding_window(index) if self.swa(index) else None
        return Attention(
            cfg.hidden_size,
            cfg.num_heads,
            2 * cfg.num_kv_heads,
            d,
            rope=self.shared_rope(rope),
            spec=AttentionSpec(scale=d**-0.5, sliding_window=window),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            sinks=self.swa(index),
        )

    def kv_layout(self) -> KVLayout:
        return KVLayout(2, 2 * self.cfg.num_kv_heads, self.cfg.head_dim)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint's attention tensors into the padded layout (see the docstring)."""
        found = _LAYER.match(name)
        if not found:
            return tensor
        cfg, d = self.cfg, self.cfg.head_dim
        vd, heads = cfg.get("v_head_dim", d), cfg.num_heads
        if found[2] == "o_proj":  # NOTE: (hidden, H * vd) -> zero columns per head
            return F.pad(tensor.view(-1, heads, vd), (0, d - vd)).view(-1, heads * d)
        kv = cfg.num_kv_heads * (2 if self.swa(int(found[1])) else 1)
        q, k, v = tensor.split([heads * d, kv * d, kv * vd])
        k, v = k.view(kv, d, *k.shape[1:]), v.view(kv, vd, *v.shape[1:])
        v = F.pad(v.movedim(1, -1), (0, d - vd)).movedim(-1, 1)
        v = v * cfg.get("attention_value_scale", 1.0)
        if kv == cfg.num_kv_heads:  # NOTE: a full layer: each K/V head stored twice
            k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        return torch.cat([q, k.flatten(0, 1), v.flatten(0, 1)])
