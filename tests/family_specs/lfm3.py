"""LFM3: LFM2's gated short convolutions beside windowed and full attention, with per-head q/k
norms, a sigmoid gate per head (``g_proj``), a rope per layer type (the full layers'
``proportional``: half of each head's frequencies rotate) and sandwich norms. Off-default: a
head dim of 16, a window of 12 that the prompts cross, a conv window of 4 with biases, an
untied head; ``lfm3_plain`` without gate and sandwich norms, tied, the default ropes."""

_LFM3 = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=72,
    sliding_window=12,
    norm_eps=1e-5,
)

SPECS = {
    "lfm3": (
        "Lfm3Config",
        _LFM3
        | dict(
            num_hidden_layers=4,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            conv_L_cache=4,
            conv_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": 5000.0,
                    "partial_rotary_factor": 0.5,
                },
            },
        ),
    ),
    "lfm3_plain": (
        "Lfm3Config",
        _LFM3
        | dict(
            num_hidden_layers=3,
            layer_types=["full_attention", "conv", "sliding_attention"],
            conv_L_cache=3,
            use_sandwich_norm=False,
            use_attention_gate=False,
            tie_word_embeddings=True,
        ),
    ),
}
