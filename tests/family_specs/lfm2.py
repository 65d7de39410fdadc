"""LFM2 and LFM2-MoE: gated short convolutions (``conv``) beside full attention with per-head
q/k norms. Off-default: conv biases, a conv window of 4, the MLP width adjusted by
``block_ffn_dim_multiplier`` and ``block_multiple_of``, an untied head; LFM2-MoE's sigmoid
routing with an expert bias, renormalised and scaled, after one dense layer."""

_LFM2 = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=4,
    conv_bias=True,
    norm_eps=1e-5,
    tie_word_embeddings=False,
)

SPECS = {
    "lfm2": (
        "Lfm2Config",
        _LFM2 | dict(intermediate_size=100, block_ffn_dim_multiplier=1.3, block_multiple_of=24),
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        _LFM2
        | dict(
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_bias=False,
            conv_L_cache=3,
            intermediate_size=72,
            moe_intermediate_size=24,
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=2,
            routed_scaling_factor=1.5,
            tie_word_embeddings=True,
        ),
    ),
}
