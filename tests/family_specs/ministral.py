"""Ministral: windows the prompts cross on the ``sliding_attention`` layers only."""

SPECS = {
    "ministral": (
        "MinistralConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=80,
            sliding_window=9,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
    ),
}
