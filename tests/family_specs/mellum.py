"""Mellum: windows the prompts cross on the sliding layers, a rope base per layer type, a
dense first layer then softmax-routed experts (renormalised), per-head q/k norms, biases."""

SPECS = {
    "mellum": (
        "MellumConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
