"""StarCoder2: LayerNorms with biases, biases on every projection (``use_bias``), a plain
tanh-GELU MLP (``c_fc``/``c_proj``), one window for every layer, and a head tied unless
the config says otherwise."""

from __future__ import annotations

from torch import nn

from warmboot.models.base import STACKED, CausalLM
from warmboot.models.layers.activation import MLP
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.norm import LayerNorm


class Starcoder2ForCausalLM(CausalLM):
    tied_by_default = True
    renames = (
        (r"^model\.", ""),
        (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    )
    stacked = {k: v for k, v in STACKED.items() if v[0] == "qkv_proj"}
    """q/k/v stacked; ``up_proj`` (``c_fc``) is the plain MLP's, not a gate/up shard."""

    def make_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        bias = bool(cfg.get("use_bias", True))
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        return DecoderLayer(
            self.attention(index, qkv_bias=bias, o_bias=bias),
            MLP(cfg.hidden_size, cfg.get("intermediate_size"), act, bias),
            self.make_norm(cfg.hidden_size),
            self.make_norm(cfg.hidden_size),
        )

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return LayerNorm(size, self.cfg.get("norm_epsilon", 1e-5))
