"""AFMoE: sandwich norms, gated attention with q/k norms, windowed rotated layers beside a
NoPE full layer, a dense first layer, sigmoid routing (renormalised, ``route_scale``) with
shared experts, muP embedding scale."""

SPECS = {
    "afmoe": (
        "AfmoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_dense_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            route_scale=2.0,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            mup_enabled=True,
            tie_word_embeddings=False,
        ),
    ),
}
