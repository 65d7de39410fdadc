"""Cohere (parallel blocks, float32 LayerNorm, interleaved rope, logit_scale; per-head q/k
LayerNorms and biases, tied; and an untied MQA variant) and Cohere 2 (windows the prompts
cross, NoPE full-attention layers)."""

SPECS = {
    "cohere": (
        "CohereConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=88,
            use_qk_norm=True,
            attention_bias=True,
            logit_scale=0.25,
            tie_word_embeddings=True,
        ),
    ),
    "cohere_untied_mqa": (
        "CohereConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            logit_scale=0.5,
            tie_word_embeddings=False,
        ),
    ),
    "cohere2": (
        "Cohere2Config",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=88,
            sliding_window=10,
            logit_scale=0.5,
            tie_word_embeddings=True,
        ),
    ),
}
