"""Laguna: a query-head count per layer, q/k norms, a rope per layer type (the full layer
half-rotated with its own base), windows the prompts cross, a per-element softplus output
gate, a dense middle layer, sigmoid routing on soft-capped logits with a perturbed choice
bias, renormalised and scaled, a shared expert."""

SPECS = {
    "laguna": (
        "LagunaConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_attention_heads_per_layer=[4, 2, 6],
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_layer_types=["sparse", "dense", "sparse"],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
            rope_parameters={
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": 50000.0,
                    "partial_rotary_factor": 0.5,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            gating="per-element",
            moe_router_logit_softcapping=2.0,
            moe_routed_scaling_factor=1.5,
            tie_word_embeddings=False,
        ),
    ),
}
