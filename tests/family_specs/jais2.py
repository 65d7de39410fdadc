"""Jais 2: LayerNorms with biases, biases on every projection, a squared-ReLU plain MLP,
odd head size."""

SPECS = {
    "jais2": (
        "Jais2Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=96,
            layer_norm_eps=1e-4,
            tie_word_embeddings=False,
        ),
    ),
}
