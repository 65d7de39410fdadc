"""LongCat-Flash: two MLA sublayers a layer (each its own latent cache: engine layers 2l and
2l + 1), two dense MLPs, a shortcut MoE with zero (identity) experts that the test prompts
pick (softmax routing with a correction bias, scaled, not renormalised). Off defaults: yarn
rope with ``mscale_all_dim``, attention biases, an odd expert mix (5 routed, 3 zero, top 3)."""

SPECS = {
    "longcat_flash": (
        "LongcatFlashConfig",
        dict(
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=48,
            qk_rope_head_dim=16,
            head_dim=16,  # NOTE: transformers' rope width: qk_rope_head_dim's
            qk_nope_head_dim=16,
            v_head_dim=12,
            ffn_hidden_size=80,
            expert_ffn_hidden_size=24,
            n_routed_experts=5,
            zero_expert_num=3,
            moe_topk=3,
            routed_scaling_factor=1.7,
            attention_bias=True,
            rms_norm_eps=1e-5,
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
            tie_word_embeddings=False,
        ),
    ),
}
