"""OLMo (the first): weightless LayerNorms, q/k/v clamped (``clip_qkv`` well inside the
projections' range), attention biases."""

SPECS = {
    "olmo_clip": (
        "OlmoConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=88,
            clip_qkv=1.0,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
