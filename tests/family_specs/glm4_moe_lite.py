"""GLM-4.7-Flash: DeepSeek-V3's latent attention and routing (two groups of four, one kept,
renormalised, scaled), dense layers named by ``mlp_layer_types`` (a sparse layer between two
dense ones: not a dense prefix), full-rank query, rope halves."""

SPECS = {
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=48,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=12,
            intermediate_size=80,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
            mlp_layer_types=["sparse", "dense", "sparse"],
            rope_interleave=False,
            tie_word_embeddings=False,
        ),
    ),
}
