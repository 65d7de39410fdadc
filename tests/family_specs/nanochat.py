"""NanoChat: weightless norms (one after the embedding), the reversed rope then per-head
q/k norms, a squared-ReLU plain MLP, attention biases, logits soft-capped where they reach."""

SPECS = {
    "nanochat": (
        "NanoChatConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            attention_bias=True,
            final_logit_softcapping=4.0,
            tie_word_embeddings=False,
        ),
    ),
}
