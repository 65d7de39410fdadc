"""Phi-MoE (Phi-3.5-MoE): LayerNorm with bias, q/k/v/o biases, a biased head, sparsemixer
top-2 routing (a jitter wide enough that the masks keep several experts in the softmax)
and longrope whose frequencies stay the short ones while cos/sin take the short or long
``mscale`` by the sequence's length (the prompts cross the original length); a window the
prompts cross."""

_ORIG = 32
SPECS = {
    "phimoe": (
        "PhimoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            num_local_experts=6,
            num_experts_per_tok=2,
            router_jitter_noise=0.3,
            sliding_window=24,
            attention_bias=True,
            lm_head_bias=True,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
                "short_mscale": 1.1,
                "long_mscale": 1.3,
                "original_max_position_embeddings": _ORIG,
            },
            tie_word_embeddings=False,
        ),
    ),
}
