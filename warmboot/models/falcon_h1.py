"""Falcon-H1 (TII): attention and a Mamba 2 mixer side by side in every layer, on the same
normed input, their outputs summed into the residual; then a gated MLP. muP multipliers
everywhere: on the embeddings and the logits (``embedding_multiplier``,
``lm_head_multiplier``), on the Mamba input and on each part of its ``in_proj`` output
(``ssm_in_multiplier``, ``ssm_multipliers``: z, x, B, C, dt), its output
(``ssm_out_multiplier``), the attention's input, keys and output (``attention_in_multiplier``,
``key_multiplier``, folded into the score scale, ``attention_out_multiplier``) and the MLP's
gate and output (``mlp_multipliers``). The Mamba output is gated by SiLU(z), normed by a
grouped RMSNorm first (``mamba_rms_norm``, the gate before or after it). Each layer both
attends (its K/V in the paged cache) and keeps the mixer's state."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from warmboot.kernels.backend import ATTENTION, AttentionSpec, KVLayout
from warmboot.models.granitemoehybrid import mamba_mixer
from warmboot.models.layers.activation import GatedMLP
from warmboot.models.layers.mamba2 import Mamba2Mixer
from warmboot.models.llama import LlamaForCausalLM


class FalconH1GatedNorm(nn.Module):
    """Falcon-H1's grouped RMSNorm of the Mamba output, in float32: the SiLU gate after the
    weighted norm (``norm_before_gate``) or before the norm."""

    def __init__(self, size: int, eps: float, groups: int, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.groups, self.norm_before_gate = eps, groups, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        if not self.norm_before_gate:
            x = x * F.silu(gate.float())
        xf = x.float().view(*shape[:-1], self.groups, -1)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = (self.weight.view(self.groups, -1) * xf).view(shape)
        if self.norm_before_gate:
            xf = xf * F.silu(gate.float())
        return xf.to(dtype)


class FalconH1MLP(GatedMLP):
    """``down(up(x) * act(gate(x) * g)) * d`` (``mlp_multipliers`` g, d)."""

    def __init__(self, hidden, intermediate, act, bias, multipliers: list[float]):
        super().__init__(hidden, intermediate, act, bias)
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, mamba, self_attn, feed_forward, input_layernorm, pre_ff_layernorm, mults):
        super().__init__()
        self.mamba, self.self_attn, self.feed_forward = mamba, self_attn, feed_forward
        self.input_layernorm, self.pre_ff_layernorm = input_layernorm, pre_ff_layernorm
        self.ssm_out, self.attn_in, self.attn_out = mults

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        h = self.input_layernorm(x)
        m = self.mamba(h, positions, step) * self.ssm_out
        a = self.self_attn(h * self.attn_in, positions, step) * self.attn_out
        x = x + (m + a)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(LlamaForCausalLM):
    renames = ((r"^model\.", ""), (r"^final_layernorm\.", "norm."))

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_scale = cfg.get("embedding_multiplier", 1.0)
        self.logit_scale = cfg.get("lm_head_multiplier", 1.0)

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        scale = cfg.head_dim**-0.5 * cfg.get("key_multiplier", 1.0)
        attn = self.attention(index, spec=AttentionSpec(scale=scale), **self.attention_options())
        mlp = FalconH1MLP(
            cfg.hidden_size,
            cfg.get("intermediate_size"),
            cfg.get("hidden_act", "silu"),
            bool(cfg.get("mlp_bias", False)),
            cfg.get("mlp_multipliers", [1.0, 1.0]),
        )
        mults = [cfg.get(k, 1.0) for k in ("ssm_out_multiplier", "attention_in_multiplier")]
        mults.append(cfg.get("attention_out_multiplier", 1.0))
        norm = self.make_norm
        return FalconH1Layer(
            self.mamba(), attn, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size), mults
        )

    def mamba(self) -> Mamba2Mixer:
        cfg = self.cfg
        inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2) * cfg.hidden_size)
        norm = None
        if cfg.get("mamba_rms_norm", False):
            groups, before = cfg.get("mamba_n_groups", 1), cfg.get("mamba_norm_before_gate", True)
            norm = FalconH1GatedNorm(inner, cfg.get("rms_norm_eps", 1e-5), groups, bool(before))
        return mamba_mixer(
            cfg,
            inner,
            out_bias=bool(cfg.get("projectors_bias", False)),
            norm=norm,
            in_scale=cfg.get("ssm_in_multiplier", 1.0),
            multipliers=cfg.get("ssm_multipliers", [1.0] * 5),
        )

    def with_states(self, layout: KVLayout) -> KVLayout:
        """Every layer attends and keeps its mixer's state."""
        states = tuple(m.state_specs() for m in self.state_mixers())
        kinds = (ATTENTION,) * len(states)
        return dataclasses.replace(layout, kinds=kinds, states=states)

    def sliding_window(self, index: int) -> int | None:
        return None
