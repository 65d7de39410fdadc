"""HyperCLOVA X: Peri-LN (a norm on each sublayer's output), Granite's multipliers with the
logits multiplied, a head size apart from hidden / heads, biases; and without Peri-LN, tied."""

SPECS = {
    "hyperclovax": (
        "HyperCLOVAXConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.09,
            logits_scaling=2.5,
            attention_bias=True,
            use_post_norm=True,
            tie_word_embeddings=False,
        ),
    ),
    "hyperclovax_plain": (
        "HyperCLOVAXConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=64,
            embedding_multiplier=2.0,
            residual_multiplier=0.8,
            logits_scaling=0.5,
            use_post_norm=False,
            tie_word_embeddings=True,
        ),
    ),
}
