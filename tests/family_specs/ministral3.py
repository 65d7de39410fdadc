"""Ministral 3: the Llama 4 query scale stepping up every 16 positions (the prompts cross
several steps) over a yarn rope, a window the prompts cross on every layer."""

SPECS = {
    "ministral3": (
        "Ministral3Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=80,
            sliding_window=11,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 100000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.4,
            },
            tie_word_embeddings=False,
        ),
    ),
}
