"""dots.llm1: DeepSeek-V3's routing (sigmoid, one group, renormalised, scaled), two shared
experts (every layer sparse), over Qwen3's attention with a window on the upper layers."""

SPECS = {
    "dots1": (
        "Dots1Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=0,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            sliding_window=20,
            max_window_layers=2,
            tie_word_embeddings=False,
        ),
    ),
}
