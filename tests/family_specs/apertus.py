"""Apertus: the learned xIELU activation in a plain MLP, per-head q/k norms, attention
biases, renamed layer norms."""

SPECS = {
    "apertus": (
        "ApertusConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
