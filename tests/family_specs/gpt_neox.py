"""GPT-NeoX: per-head interleaved fused qkv, partial rotary (``rotary_pct``), LayerNorms with
biases, a plain GELU MLP; parallel and sequential residuals, with and without attention
biases."""

SPECS = {
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
    ),
    "gpt_neox_sequential": (
        "GPTNeoXConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=88,
            rotary_pct=0.5,
            use_parallel_residual=False,
            attention_bias=False,
            hidden_act="gelu_new",
            tie_word_embeddings=False,
        ),
    ),
}
