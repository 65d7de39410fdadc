"""StarCoder2: LayerNorms and linear biases, a plain tanh-GELU MLP, a window the prompts
cross, tied head."""

SPECS = {
    "starcoder2": (
        "Starcoder2Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            sliding_window=12,
            use_bias=True,
            tie_word_embeddings=True,
        ),
    ),
}
