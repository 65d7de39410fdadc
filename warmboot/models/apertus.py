"""Apertus (Swiss AI): Llama with per-head q/k RMSNorms, its norms named
``attention_layernorm`` and ``feedforward_layernorm``, and a plain bias-free MLP whose
activation is xIELU (learned ``alpha_p``, ``alpha_n`` per layer; ``beta``, ``eps`` stored)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.models.base import STACKED
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.linear import Linear
from warmboot.models.llama import LlamaForCausalLM


class XIELU(nn.Module):
    """``a_p x^2 + b x`` for x > 0, else ``(expm1(min(x, eps)) - x) a_n + b x``, with
    ``a_p = softplus(alpha_p)``, ``a_n = b + softplus(alpha_n)``, in the input's dtype
    (transformers' Python xIELU); ``beta`` and ``eps`` are the checkpoint's too."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.empty(1)), nn.Parameter(torch.empty(1))
        self.beta, self.eps = nn.Parameter(torch.empty(())), nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, positive, negative)


class XieluMLP(nn.Module):
    """``down(xielu(up(x)))`` without biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate)
        self.act_fn = XIELU()
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    qk_norm = True
    renames = (
        (r"^model\.", ""),
        (r"\.attention_layernorm\.", ".input_layernorm."),
        (r"\.feedforward_layernorm\.", ".post_attention_layernorm."),
    )
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """q/k/v stacked; ``up_proj`` is the plain MLP's, not a gate/up shard."""

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act = cfg.get("hidden_act", "xielu")
        if act == "xielu":
            return XieluMLP(cfg.hidden_size, cfg.get("intermediate_size"))
        return MLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias=False)
