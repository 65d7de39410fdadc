"""DeepSeek-V4: shared-K/V MQA (one K = V head) over a sliding window with attention sinks,
beside K/V compressed every ``rate`` tokens by a learned gated pooling: compressed sparse
attention (overlapping windows, a lightning indexer picking ``index_topk`` entries) and
heavily compressed attention (every entry); hyper-connection streams with Sinkhorn-mixed
residuals; hash-routed MoE layers (``tid2eid``) before top-k ones, sqrt-softplus scores.
Rates 2 and 8 and a window of 8 against prompts of up to 67 tokens: many groups close inside
prefill chunks and decodes; ``index_topk`` 3 keeps the selection short of the entries; 32
indexer heads keep ReLU-zero ties rare; ``swiglu_limit`` low enough to clamp."""

SPECS = {
    "deepseek_v4": (
        "DeepseekV4Config",
        dict(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            qk_rope_head_dim=16,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            routed_scaling_factor=1.5,
            layer_types=[
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
            sliding_window=8,
            index_n_heads=32,
            index_head_dim=24,
            index_topk=3,
            hc_mult=3,
            hc_sinkhorn_iters=5,
            swiglu_limit=1.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
