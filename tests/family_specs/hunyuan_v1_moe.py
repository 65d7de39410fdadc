"""Hunyuan MoE (V1): the dense family's q/k norms after the rope and fixed-alpha NTK rope
over MoE blocks: a float32 router (softmax, top-k renormalised; ``moe_topk`` per layer) and
an ungated shared MLP."""

SPECS = {
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=40,
            num_experts=8,
            moe_topk=[2, 3, 2],
            rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
            tie_word_embeddings=False,
        ),
    ),
}
