"""GLM-4.5: DeepSeek-V3's routing (sigmoid, two groups of four, one kept, not renormalised,
scaled) and a shared expert, every layer sparse (the dense first layers: deepseek_v3), over
GQA with q/k/v biases, per-head q/k norms and half of each head rotated."""

SPECS = {
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            routed_scaling_factor=1.8,
            use_qk_norm=True,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
