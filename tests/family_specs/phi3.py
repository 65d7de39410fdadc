"""Phi-3: fused qkv and gate/up checkpoints; one spec with the default rope and a window the
prompts cross, one with longrope (Phi-4-mini's partial rotary 0.75, tied head) whose
``original_max_position_embeddings`` (18) is one test prompt's length: prompts below it, at it
and past it (a past one rotates every position with the long factors, chunked or not), and
generations that cross it."""

SPECS = {
    "phi3": (
        "Phi3Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            sliding_window=20,
            tie_word_embeddings=False,
        ),
    ),
    "phi3_longrope": (
        "Phi3Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=80,
            partial_rotary_factor=0.75,
            max_position_embeddings=128,
            original_max_position_embeddings=18,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0],
            },
            tie_word_embeddings=True,
        ),
    ),
}
