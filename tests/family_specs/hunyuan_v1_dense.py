"""Hunyuan dense: q/k norms after the rope, the fixed-alpha NTK rope ("dynamic" + alpha)."""

SPECS = {
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=88,
            rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
            tie_word_embeddings=False,
        ),
    ),
}
