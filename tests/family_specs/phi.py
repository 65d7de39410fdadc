"""Phi (phi-2): one LayerNorm feeding attention and MLP in parallel, biases everywhere (the
LM head's too), half the head rotated; a second spec with q/k LayerNorms and grouped KV."""

SPECS = {
    "phi": (
        "PhiConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
        ),
    ),
    "phi_qk_norm": (
        "PhiConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            partial_rotary_factor=0.4,
            qk_layernorm=True,
            tie_word_embeddings=False,
        ),
    ),
}
