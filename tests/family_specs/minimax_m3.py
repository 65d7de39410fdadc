"""MiniMax-M3 (text): block-sparse layers beside dense ones. Blocks of 4 positions, 3 taken
per KV head (the query's own among them) against prompts of up to 67 tokens (17 blocks);
partial rope, the indexer rotating its first 8 dims of 12; a clamp the SwiGLU reaches;
dense and sparse MLPs."""

SPECS = {
    "minimax_m3": (
        "MiniMaxM3VLTextConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=24,
            dense_intermediate_size=48,
            shared_intermediate_size=16,
            num_local_experts=6,
            num_experts_per_tok=2,
            routed_scaling_factor=1.5,
            swiglu_limit=0.5,
            layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            index_n_heads=2,
            index_head_dim=12,
            index_block_size=4,
            index_topk_blocks=3,
            index_local_blocks=1,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
        ),
    ),
}
