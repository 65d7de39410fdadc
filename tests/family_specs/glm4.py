"""GLM and GLM-4: fused gate/up, q/k/v biases, half the head rotated with interleaved pairs
(GLM-4: post-attention and post-MLP norms)."""

SPECS = {
    "glm4": (
        "Glm4Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=96,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "glm": (
        "GlmConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=20,
            intermediate_size=80,
            partial_rotary_factor=0.6,
            tie_word_embeddings=True,
        ),
    ),
}
