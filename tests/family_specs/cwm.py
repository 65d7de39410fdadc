"""CWM: transformers' default layer pattern (full attention on the first layer, windows the
prompts cross on the others), MLP biases, a llama3 rope."""

SPECS = {
    "cwm": (
        "CwmConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=72,
            sliding_window=7,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
}
