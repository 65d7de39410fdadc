"""Command A MoE: parallel blocks with a dense first layer (rotated though full: the prefix
pattern 1), windowed and NoPE full layers after it, sigmoid routing of the top-k logits,
renormalised, a shared expert averaged in, RMSNorm (``rms_norm_eps``), a logit scale."""

SPECS = {
    "cohere2_moe": (
        "Cohere2MoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=24,
            prefix_dense_intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="average",
            expert_selection_fn="sigmoid",
            norm_topk_prob=True,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            sliding_window=8,
            rms_norm_eps=1e-5,
            logit_scale=0.5,
            tie_word_embeddings=True,
        ),
    ),
}
