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
            max_position_embeddings=48,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            tie_word_embeddings=True,
        ),
    ),
}
