"""Llama-family variants: MLP biases, attention biases, explicit head_dim, yarn and dynamic
rope (generation crosses ``original_max_position_embeddings``)."""

SPECS = {
    "llama_mlp_bias": (
        "LlamaConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=20,
            intermediate_size=88,
            mlp_bias=True,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        ),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=18,  # NOTE: prompts below, at and past it
            rope_scaling={"rope_type": "dynamic", "factor": 6.0},
            tie_word_embeddings=True,
        ),
    ),
}

SPECS |= {
    "granite": (
        "GraniteConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.09,
            logits_scaling=2.5,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=10,
            tie_word_embeddings=True,
        ),
    ),
}
