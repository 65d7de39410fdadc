"""Granite SWA: attention sinks, transformers' default layer pattern (the first layer full,
the others windowed, a window the prompts cross), a NoPE layer and two rope bases
(``layer_rope_theta``), Granite's multipliers, tied head."""

SPECS = {
    "granite_swa": (
        "GraniteSWAConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            sliding_window=8,
            layer_rope_theta=[0, 10000.0, 300.0],
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.09,
            logits_scaling=2.5,
            tie_word_embeddings=True,
        ),
    ),
}
