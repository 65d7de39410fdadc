"""Lightning attention (MiniMax): linear attention with a fixed decay per head, in the place of
softmax attention in most of MiniMax's layers.

Per token: one projection gives q, k, v (per head consecutive, activated by the model's
``hidden_act``) and, from the same input, the output gate; each head's state ``S`` (D x D)
decays by ``exp(-slope)`` and adds ``k v^T``; the output ``S^T q`` (no scale) of all heads is
RMS-normed together (eps 1e-6), multiplied by ``sigmoid(gate)`` and projected out. The slopes
follow from the head count and the layer's depth (``kernels.lightning.slopes``), not the
checkpoint. A request keeps ``S`` (float32) in its state slot.
"""

from __future__ import annotations

import torch

from warmboot.kernels import state_ops
from warmboot.kernels.backend import StateSpec
from warmboot.kernels.lightning import slopes
from warmboot.models.layers.activation import activation
from warmboot.models.layers.linear import Linear
from warmboot.models.layers.norm import RMSNorm
from warmboot.models.layers.state import StateMixer

NORM_EPS = 1e-6
"""The output norm's eps (transformers' default; the config's ``rms_norm_eps`` is not it)."""


class LightningAttention(StateMixer):
    """``in_proj``: the checkpoint's ``qkv_proj`` and ``output_gate`` stacked (one GEMM)."""

    kind = "lightning"

    def __init__(
        self, hidden: int, heads: int, head_dim: int, layer: int, num_layers: int, act: str
    ):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.layer, self.num_layers = layer, num_layers
        width = heads * head_dim
        self.sizes = [3 * width, width]  # q/k/v, gate
        self.in_proj = Linear(hidden, list(self.sizes))
        self.act = activation(act)
        self.norm = RMSNorm(width, NORM_EPS)
        self.out_proj = Linear(width, hidden)

    def state_specs(self) -> tuple[StateSpec, ...]:
        d = self.head_dim
        return (StateSpec("recurrent", (self.heads, d, d), float32=True),)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        n, h, d = x.shape[0], self.heads, self.head_dim
        qkv, gate = self.in_proj(x).split(self.sizes, dim=-1)
        q, k, v = self.act(qkv).view(n, h, 3, d).unbind(2)
        slope = slopes(h, self.layer, self.num_layers, device=x.device)
        o = state_ops.call_lightning(self, step, q, k, v, slope)
        o = self.norm(o.reshape(n, h * d))
        return self.out_proj(torch.sigmoid(gate) * o)
