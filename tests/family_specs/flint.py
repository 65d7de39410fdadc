"""Flint: per-head sinks on every layer, a small window on the rotated sliding layers around
a NoPE full layer, q/k norms, a dense middle layer (``mlp_only_layers``), sigmoid top-k routing
renormalised, and an ungated shared expert."""

SPECS = {
    "flint": (
        "FlintConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            sliding_window=9,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
    ),
}
