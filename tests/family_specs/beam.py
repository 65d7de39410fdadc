"""Beam: depth-scaled sandwich residuals, biased per-head output gates, q/k norms, a small
window on the rotated sliding layers around a NoPE full layer with scalable-softmax queries,
a dense layer then grouped sigmoid routing (two groups of four, one kept) scaled after the
sum, and soft-capped logits. The depth scales and the routed scale are uniform per position,
so the norms after them hide them but for eps: a large ``rms_norm_eps`` makes them count."""

SPECS = {
    "beam": (
        "BeamConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.7,
            sliding_window=9,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            final_logit_softcapping=2.5,
            rms_norm_eps=0.5,
            tie_word_embeddings=False,
        ),
    ),
}
