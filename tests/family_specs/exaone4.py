"""EXAONE 4: hybrid layers (windows the prompts cross, NoPE global layers), per-head q/k
norms, odd head size; and a config without windows (rope on every layer), tied."""

SPECS = {
    "exaone4": (
        "Exaone4Config",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            sliding_window=10,
            sliding_window_pattern=2,
            tie_word_embeddings=False,
        ),
    ),
    "exaone4_full_tied": (
        "Exaone4Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            sliding_window=None,
            layer_types=["full_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
    ),
}
