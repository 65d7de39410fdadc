"""OLMo 2 (post-norm, q/k norm over the whole projection; biases, odd head size) and OLMo 3
(windows the prompts cross on three of four layers, a yarn rope on the full-attention ones)."""

SPECS = {
    "olmo2": (
        "Olmo2Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "olmo2_tied_mqa": (
        "Olmo2Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            tie_word_embeddings=True,
        ),
    ),
    "olmo3": (
        "Olmo3Config",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                    "rope_theta": 50000.0,
                },
            },
            tie_word_embeddings=False,
        ),
    ),
}
