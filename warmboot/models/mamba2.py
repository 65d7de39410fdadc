"""Mamba 2 (``Mamba2ForCausalLM``): attention-free, every layer ``x + mixer(norm(x))`` with a
Mamba 2 mixer and no MLP; checkpoint names under ``backbone.`` (``embeddings`` or the older
``embedding``, ``norm_f``). With ``residual_in_fp32`` (the default) the residual stream is
kept in float32 between the layers, each norm reading it cast to the weights' dtype, and the
final norm's output is cast back for the LM head, as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import CausalLM
from warmboot.models.layers.mamba2 import Mamba2Mixer
from warmboot.models.layers.norm import RMSNorm


class CastRMSNorm(RMSNorm):
    """An RMSNorm of the float32 residual stream, cast to the weight's dtype (the LM head's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(self.weight.dtype)


class Mamba2Block(nn.Module):
    """``residual + mixer(norm(x))``; the residual in float32 with ``residual_in_fp32``."""

    def __init__(self, norm: nn.Module, mixer: nn.Module, residual_in_fp32: bool):
        super().__init__()
        self.norm, self.mixer = norm, mixer
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), positions, step)
        return residual + h


class Mamba2ForCausalLM(CausalLM):
    renames = (
        (r"^backbone\.", ""),
        (r"^embeddings?\.", "embed_tokens."),
        (r"^norm_f\.", "norm."),
    )

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        return Mamba2Block(
            RMSNorm(cfg.hidden_size, self.eps()), self.mixer(), self.residual_in_fp32()
        )

    def mixer(self) -> Mamba2Mixer:
        cfg = self.cfg
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"a Mamba conv activation {act!r} is not served (silu only)"
            )
        heads, head_dim = cfg.get("num_heads", 128), cfg.get("head_dim", 64)
        inner = int(cfg.get("expand", 2) * cfg.hidden_size)
        if heads * head_dim != inner:
            raise UnsupportedModelError(f"num_heads x head_dim != {inner} (expand x hidden_size)")
        bias = bool(cfg.get("use_bias", False))
        return Mamba2Mixer(
            cfg.hidden_size,
            num_heads=heads,
            head_dim=head_dim,
            n_groups=cfg.get("n_groups", 8),
            d_state=cfg.get("state_size", 128),
            conv_kernel=cfg.get("conv_kernel", 4),
            chunk_size=cfg.get("chunk_size", 256),
            eps=self.eps(),
            conv_bias=bool(cfg.get("use_conv_bias", True)),
            in_bias=bias,
            out_bias=bias,
            dt_limit=cfg.get("time_step_limit"),
        )

    def eps(self) -> float:
        return self.cfg.get("layer_norm_epsilon", 1e-5)

    def residual_in_fp32(self) -> bool:
        return bool(self.cfg.get("residual_in_fp32", True))

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return (CastRMSNorm if self.residual_in_fp32() else RMSNorm)(size, self.eps())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x.float() if self.residual_in_fp32() else x
