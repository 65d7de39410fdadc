"""Hy3: per-head q/k norms before the rope, a dense first layer, then sigmoid routing with a
correction bias on the choice, renormalised and scaled, two shared experts as one MLP,
biases on the attention and the MLPs."""

SPECS = {
    "hy_v3": (
        "HYV3Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=2,
            router_scaling_factor=1.7,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
