"""Arcee (AFM): Llama with a plain MLP ``down(act(up(x)))``, by default ReLU squared."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.models.base import STACKED
from warmboot.models.layers.activation import MLP
from warmboot.models.llama import LlamaForCausalLM


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ArceeForCausalLM(LlamaForCausalLM):
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """NOTE: ``up_proj`` is the MLP's only input projection here, not a gate/up shard."""

    def make_mlp(self, index: int) -> nn.Module:
        cfg = self.cfg
        act, bias = cfg.get("hidden_act", "relu2"), bool(cfg.get("mlp_bias", False))
        mlp = MLP(
            cfg.hidden_size, cfg.get("intermediate_size"), "relu" if act == "relu2" else act, bias
        )
        if act == "relu2":
            mlp.act = relu_squared
        return mlp
