"""Arcee: plain ReLU-squared MLP with biases, odd head size, tied."""

SPECS = {
    "arcee": (
        "ArceeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
}
