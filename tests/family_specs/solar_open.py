"""Solar Open: GLM-4.5's routing (sigmoid, correction bias, two groups of four, one kept,
renormalised, scaled) and a shared expert on every layer, over Llama attention with q/k/v
biases and none on o_proj."""

SPECS = {
    "solar_open": (
        "SolarOpenConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
