"""NanoChat (Karpathy): a Llama whose RMSNorms have no weight (one more after the embedding),
whose rope turns the other way (``rotate_half`` flipped: sin negated) and is followed by
per-head q/k norms, with a plain squared-ReLU MLP (``fc1``, ``fc2``), biases on every attention
projection or none (``attention_bias``) and soft-capped logits."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.config import ModelConfig
from warmboot.models.base import STACKED
from warmboot.models.hunyuan_v1_dense import RopeThenNorm
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.rope import RotaryEmbedding
from warmboot.models.llama import LlamaForCausalLM


class UnitRMSNorm(nn.Module):
    """RMSNorm without a weight, in float32, cast back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class ReversedRotaryEmbedding(RotaryEmbedding):
    """Rotates by minus the angle: NanoChat's ``rotate_half`` is the usual one negated."""

    def _cos_sin(self, freqs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._cos_sin(freqs, scale)
        return cos, -sin


class NanoChatForCausalLM(LlamaForCausalLM):
    rope_class = ReversedRotaryEmbedding
    renames = (
        (r"^model\.", ""),
        (r"\.mlp\.fc1\.", ".mlp.up_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
    )
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """q/k/v stacked; ``up_proj`` (``fc1``) is the plain MLP's, not a gate/up shard."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.final_softcap = cfg.hf.get("final_logit_softcapping", 15.0)

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return UnitRMSNorm(self.cfg.get("rms_norm_eps", 1e-6))

    def attention_options(self) -> dict:
        bias = bool(self.cfg.get("attention_bias", False))
        rope = self.shared_rope(self.rope_spec())
        d = self.cfg.head_dim
        norms = RopeThenNorm(rope, self.make_norm(d), self.make_norm(d))
        return dict(qkv_bias=bias, o_bias=bias, rope=norms)

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        return MLP(cfg.hidden_size, cfg.get("intermediate_size"), cfg.get("hidden_act"), False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(super().embed(input_ids))  # NOTE: the final norm, before the layers too
