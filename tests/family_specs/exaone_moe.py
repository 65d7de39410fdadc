"""K-EXAONE: pre-norm layers with EXAONE 4's attention (q/k norms, windowed layers rotated,
the global layer NoPE), a dense first layer, then DeepSeek-V3's MoE (two groups of four, one
kept, renormalised, scaled) with two shared experts."""

SPECS = {
    "exaone_moe": (
        "ExaoneMoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            num_shared_experts=2,
            norm_topk_prob=True,
            routed_scaling_factor=1.7,
            first_k_dense_replace=1,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
}
