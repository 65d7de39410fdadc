"""Youtu-LLM: multi-head latent attention (low-rank query, interleaved yarn rope with
``mscale_all_dim``) over dense gated MLPs on every layer, tied head."""

SPECS = {
    "youtu": (
        "YoutuConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=48,
            q_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=12,
            intermediate_size=80,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            tie_word_embeddings=True,
        ),
    ),
}
