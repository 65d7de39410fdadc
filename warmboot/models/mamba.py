"""Mamba (``MambaForCausalLM``) and FalconMamba (``FalconMambaForCausalLM``): attention-free,
every layer ``x + mixer(norm(x))`` with a Mamba 1 mixer (``layers/mamba1.py``) and no MLP,
laid out as Mamba 2 (``backbone.`` names, the residual in float32 with ``residual_in_fp32``).
FalconMamba RMS-normalises dt's input, B and C without weights (``mixer_rms_eps``)."""

from __future__ import annotations

import math

from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.mamba1 import Mamba1Mixer
from warmboot.models.mamba2 import Mamba2ForCausalLM


def silu_conv(cfg) -> None:
    """Refuse a Mamba conv activation other than SiLU (the config's ``hidden_act``)."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"a Mamba conv activation {act!r} is not served (silu only)")


def dt_rank(value, hidden: int) -> int:
    """A config's time-step rank: an int, or "auto" (``ceil(hidden / 16)``)."""
    return math.ceil(hidden / 16) if value in (None, "auto") else int(value)


class MambaForCausalLM(Mamba2ForCausalLM):
    tied_by_default = True
    bcdt_norm: str | None = None

    def mixer(self) -> Mamba1Mixer:
        cfg = self.cfg
        silu_conv(cfg)
        hidden = cfg.hidden_size
        bias = bool(cfg.get("use_bias", False))
        return Mamba1Mixer(
            hidden,
            inner=cfg.get("intermediate_size") or int(cfg.get("expand", 2) * hidden),
            d_state=cfg.get("state_size", 16),
            dt_rank=dt_rank(cfg.get("time_step_rank"), hidden),
            conv_kernel=cfg.get("conv_kernel", 4),
            conv_bias=bool(cfg.get("use_conv_bias", True)),
            proj_bias=bias,
            bcdt_norm=self.bcdt_norm,
            eps=cfg.get("mixer_rms_eps", 1e-6),
        )


class FalconMambaForCausalLM(MambaForCausalLM):
    bcdt_norm = "weightless"
