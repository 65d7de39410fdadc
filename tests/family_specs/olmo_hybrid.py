"""OLMo hybrid: gated DeltaNet layers (separate q/k/v/g/b/a projections, the write rate scaled
to (0, 2) by ``linear_allow_neg_eigval``) beside OLMo-style attention (norms after the
sublayers, q/k norms over all heads). Off-default: more value heads than key heads, key and
value head dims that differ, a conv kernel of 3, attention biases; ``olmo_hybrid`` rotates
(default rope, whose ``partial_rotary_factor`` transformers ignores) with the eigenvalues kept
positive, ``olmo_hybrid_nope`` is NoPE (``rope_theta`` null, as the released checkpoints)."""

_L, _F = "linear_attention", "full_attention"
# NOTE: random DeltaNet stacks grow ill-conditioned with depth (qwen3_next.py's NOTE); these
# stay at three layers.
_HYBRID = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=3,
    num_hidden_layers=3,
    tie_word_embeddings=False,
)

SPECS = {
    "olmo_hybrid": (
        "OlmoHybridConfig",
        _HYBRID
        | dict(
            layer_types=[_L, _F, _L],
            attention_bias=True,
            linear_allow_neg_eigval=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    "olmo_hybrid_nope": (
        "OlmoHybridConfig",
        _HYBRID | dict(layer_types=[_F, _L, _L], rope_theta=None, tie_word_embeddings=True),
    ),
}
