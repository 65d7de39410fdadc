"""ERNIE 4.5: interleaved float32 rope, biases on every projection, tied."""

SPECS = {
    "ernie4_5": (
        "Ernie4_5Config",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            use_bias=True,
            tie_word_embeddings=True,
        ),
    ),
}
