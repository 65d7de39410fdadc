"""Gemma 4 (text): per-layer inputs; the last two layers reading the K/V of the last earlier
layer of their type (layer 3, not 0 or 1, for the sliding one; layer 2 for the full one), with
double-wide MLPs; full layers with one K/V projection for K and V (``attention_k_eq_v``), fewer
K/V heads and wider heads than the sliding ones (the cache laid out for the widest); a window
the prompts cross; a proportional rope on the full layers; a soft-capped head. The MoE
variant: experts beside every dense MLP (per-expert scales, router scales and layer scalars
made non-trivial by ``tiny_models``), attention biases, transformers' default ropes, no
per-layer inputs or sharing."""

SLIDING, FULL = "sliding_attention", "full_attention"

SPECS = {
    "gemma4": (
        "Gemma4TextConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            global_head_dim=20,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            intermediate_size=40,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=512,
            sliding_window=11,
            final_logit_softcapping=8.0,
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
                FULL: {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 100000.0,
                },
            },
            tie_word_embeddings=True,
        ),
    ),
    "gemma4_moe": (
        "Gemma4TextConfig",
        dict(
            hidden_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=24,
            intermediate_size=36,
            layer_types=[SLIDING, FULL, FULL],
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=5,
            top_k_experts=2,
            moe_intermediate_size=20,
            attention_bias=True,
            sliding_window=9,
            tie_word_embeddings=False,
        ),
    ),
}
