"""StableLM: LayerNorms with biases, a quarter of the head rotated; StableLM 2 1.6B's shape
(q/k/v biases, sequential residual) and 12B's (per-head q/k LayerNorms stored one tensor per
head, parallel residual, grouped KV)."""

SPECS = {
    "stablelm": (
        "StableLmConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=96,
            use_qkv_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "stablelm_parallel": (
        "StableLmConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
            use_parallel_residual=True,
            tie_word_embeddings=True,
        ),
    ),
}
