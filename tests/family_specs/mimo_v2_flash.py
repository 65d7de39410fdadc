"""MiMo-V2-Flash: full layers with the KV heads of the windowed ones halved, values narrower
than keys and scaled, sinks on the windowed layers (a window the prompts cross), a rope per
layer type (partial rotary, two bases), a dense middle layer, DeepSeek-V3 routing (two groups
of four, one kept, renormalised, scaled) without shared experts."""

SPECS = {
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=24,
            v_head_dim=16,
            attention_value_scale=0.6,
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            mlp_layer_types=["sparse", "dense", "sparse"],
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            sliding_window=8,
            rope_parameters={
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": 50000.0,
                    "partial_rotary_factor": 0.334,
                },
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
            },
            tie_word_embeddings=False,
        ),
    ),
}
