"""OLMo hybrid (AllenAI): gated DeltaNet layers (``linear_attention``) beside OLMo 3 style full
attention (``full_attention``), as ``layer_types`` lists them (default: every fourth layer
attends, the last one at least).

The two layer kinds differ in more than their mixer: an attention layer puts its norms after
the sublayers (``x + norm(attn(x))``, ``x + norm(mlp(x))``, OLMo 2's), with q/k RMSNorms over
the whole projection; a DeltaNet layer is pre-norm (``x + mixer(norm(x))``). Every norm scales
in float32 before the cast (``Olmo2RMSNorm``).

The DeltaNet is Qwen3-Next's with separate q/k/v/g/b/a projections, its output gate
``g_proj``, a gated output norm of fixed eps 1e-5, and with ``linear_allow_neg_eigval`` (the
default) its write rate ``2 * sigmoid(b)`` in (0, 2): the state's transition
``I - beta k k^T`` may then have a negative eigenvalue. The conv runs ``hidden_act``.

Rope is optional: the released checkpoints are NoPE (``rope_theta`` null), a config with a
theta rotates the attention layers (tables and rotation in float32, as transformers)."""

from __future__ import annotations

from torch import nn

from warmboot.architectures import UnsupportedModelError
from warmboot.models.base import STACKED, CausalLM, checked_kinds
from warmboot.models.ernie4_5 import Float32RotaryEmbedding
from warmboot.models.layers.decoder import DecoderLayer
from warmboot.models.layers.gated_delta import GatedDeltaNet
from warmboot.models.layers.rope import RopeSpec
from warmboot.models.layers.state import QKV_CONVS, JoinedConv1dWeight
from warmboot.models.olmo2 import Olmo2ForCausalLM, Olmo2RMSNorm, PostNormDecoderLayer

KINDS = ("linear_attention", "full_attention")
DELTA_PROJECTIONS = "qkvgba"
"""The DeltaNet's checkpoint projections, in ``GatedDeltaNet.in_proj``'s row order."""
"""The DeltaNet convs as transformers saves them (it loads them concatenated, ``conv1d``)."""
DELTA_NORM_EPS = 1e-5
"""The eps of the DeltaNet's gated output norm (FLA's default, whatever ``rms_norm_eps``)."""


class OlmoHybridForCausalLM(Olmo2ForCausalLM):
    renames = (
        (r"^model\.", ""),
        (r"\.attention_layer_norm\.", ".input_layernorm."),  # NOTE: transformers' save names
        (r"\.feedforward_layer_norm\.", ".post_attention_layernorm."),
        (r"\.linear_attn\.([qkvgba])_proj\.", r".self_attn.delta_\1."),
        (r"\.linear_attn\.o_proj\.", ".self_attn.out_proj."),
        (r"\.linear_attn\.o_norm\.", ".self_attn.norm."),
        (r"\.linear_attn\.", ".self_attn."),
    )
    stacked = (
        STACKED
        | {f"delta_{p}": ("in_proj", i) for i, p in enumerate(DELTA_PROJECTIONS)}
        | {name: ("conv1d", i) for i, name in enumerate(QKV_CONVS)}
    )
    ignored = (*CausalLM.ignored, r"^(model\.)?mtp\.")
    """Multi-token-prediction weights (not served)."""
    rope_class = Float32RotaryEmbedding

    def __init__(self, cfg):
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"OLMo hybrid with hidden_act {act!r} (its DeltaNet conv); served: silu"
            )
        super().__init__(cfg)

    def layer_types(self) -> list[str]:
        """``layer_types``, else transformers' default."""
        n = self.cfg.num_layers
        types = self.cfg.get("layer_types")
        if types is None:
            types = [KINDS[i % 4 == 3] for i in range(n)]
            if KINDS[1] not in types:
                types[-1] = KINDS[1]
        return checked_kinds(types, n, KINDS, "OLMo hybrid ")

    def make_norm(self, size: int | tuple[int, ...]) -> nn.Module:
        return Olmo2RMSNorm(size, self.cfg.get("rms_norm_eps", 1e-6))

    def make_layer(self, index: int) -> nn.Module:
        cfg, norm = self.cfg, self.make_norm
        mlp = self.make_mlp(index)
        if self.layer_types()[index] == "full_attention":
            attn = self.attention(index, **self.attention_options(index))
            return PostNormDecoderLayer(attn, mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))
        return DecoderLayer(self.delta_net(), mlp, norm(cfg.hidden_size), norm(cfg.hidden_size))

    def delta_net(self) -> GatedDeltaNet:
        cfg = self.cfg
        nk = cfg.get("linear_num_key_heads", cfg.num_heads)
        nv = cfg.get("linear_num_value_heads", cfg.num_heads)
        dk = cfg.get("linear_key_head_dim", int(0.75 * cfg.hidden_size / nk))
        dv = cfg.get("linear_value_head_dim", 2 * dk)
        key, value = nk * dk, nv * dv
        net = GatedDeltaNet(
            cfg.hidden_size,
            nk,
            nv,
            dk,
            dv,
            cfg.get("linear_conv_kernel_dim", 4),
            DELTA_NORM_EPS,
            in_shards=[key, key, value, value, nv, nv],
            beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
        )
        net.conv1d = JoinedConv1dWeight(2 * key + value, net.conv1d.kernel)
        return net

    def attention_options(self, index: int) -> dict:
        options = super().attention_options(index)
        return options if self.rope_theta() is not None else options | dict(rope=None)

    def sliding_window(self, index: int) -> int | None:
        return None

    def rope_theta(self) -> float | None:
        """The attention layers' theta as transformers resolves it; None: NoPE."""
        theta = self.cfg.hf.get("rope_theta", 10000.0)
        return self.rope_parameters().get("rope_theta", theta)

    def rope_parameters(self) -> dict:
        cfg = self.cfg
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if any(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError("OLMo hybrid rope_parameters per layer type")
        return dict(params)

    def rope_spec(self, **overrides) -> RopeSpec:
        """One rope: transformers' default type rotates the whole head whatever its
        ``partial_rotary_factor``; the scaled types would fail on one, so it is refused."""
        params = self.rope_parameters()
        params["rope_theta"] = self.rope_theta() or 10000.0  # NOTE: NoPE builds none
        partial = params.pop("partial_rotary_factor", self.cfg.get("partial_rotary_factor", 1.0))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default") and partial != 1.0:
            raise UnsupportedModelError(
                f"OLMo hybrid rope_type {kind!r} with partial_rotary_factor {partial}"
            )
        kwargs = dict(max_position_embeddings=self.cfg.max_position_embeddings) | overrides
        return RopeSpec.parse(params, **kwargs)
