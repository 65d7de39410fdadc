"""A.X-K1: DeepSeek-V3's latent attention (query LoRA, interleaved rope) and routing (two
groups of four, one kept, renormalised, scaled), a dense layer between sparse ones, and the
RMSNorm on each sparse block's output (its weight off one, so it is checked)."""

SPECS = {
    "axk1": (
        "AXK1Config",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=48,
            q_lora_rank=40,
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
            routed_scaling_factor=2.2,
            mlp_layer_types=["sparse", "dense", "sparse"],
            tie_word_embeddings=False,
        ),
    ),
}
