"""Gemma 3n (text): AltUp with three copies and the second one active (its correction adds
the per-layer inputs to copies 1..n, the active one among them), LAuReL of rank 5, a
Gaussian top-k cut on the gates of three layers (one of them a shared layer), per-layer
inputs from a table smaller than the vocabulary (the ids past it read row 0), per-layer
MLP widths, attention biases, and the last two layers reading the K/V of the last earlier
layer of their type (layer 1 for the full one, layer 3, not 2 or 0, for the sliding one),
under a window the prompts cross; a rope per layer type."""

SLIDING, FULL = "sliding_attention", "full_attention"

SPECS = {
    "gemma3n_shared_kv": (
        "Gemma3nTextConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=[64, 80, 56, 72, 64, 88],
            layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING],
            num_kv_shared_layers=2,
            sliding_window=11,
            activation_sparsity_pattern=[0.9, 0.0, 0.6, 0.0, 0.95, 0.0],
            altup_num_inputs=3,
            altup_active_idx=1,
            laurel_rank=5,
            hidden_size_per_layer_input=12,
            vocab_size_per_layer_input=400,
            attention_bias=True,
            final_logit_softcapping=8.0,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
}
