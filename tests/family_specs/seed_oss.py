"""Seed-OSS: q/k/v biases, a separate o_proj bias, MLP biases, odd head size, untied."""

SPECS = {
    "seed_oss": (
        "SeedOssConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            attention_out_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
