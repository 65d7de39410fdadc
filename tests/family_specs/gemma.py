"""Gemma 1, 2 and 3 (text): an untied MQA head with attention biases (Gemma 1); soft-caps
small enough to bite and a non-default ``query_pre_attn_scalar`` (Gemma 2, 3); sliding
windows the prompts cross; Gemma 3's per-layer-type ropes (linear scaling on the full
layers, another theta on the sliding ones). Head sizes are even (rope needs it) but not
powers of two."""

SPECS = {
    "gemma_untied_mqa": (
        "GemmaConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=20,
            intermediate_size=88,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2_softcap": (
        "Gemma2Config",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=22,
            intermediate_size=96,
            query_pre_attn_scalar=40,
            sliding_window=10,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_local_rope": (
        "Gemma3TextConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=18,
            intermediate_size=80,
            query_pre_attn_scalar=24,
            sliding_window=9,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            attn_logit_softcapping=4.0,  # NOTE: transformers' Gemma 3 ignores it; so do we
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
        ),
    ),
}
