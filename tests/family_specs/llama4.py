"""Llama 4 text: chunks of 8 positions on the rope layers (the prompts, up to 67 positions,
cross many; a prefill chunk of 16 crosses two), NoPE layers (one dense, one MoE) whose
temperature-tuned query scale steps every 4 positions, L2 q/k norms after the interleaved
rope (llama3-scaled), dense and MoE layers (top-2 of 4 experts by logit, the inputs scaled
by the sigmoid), attention biases."""

SPECS = {
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 0, 0, 1],
            attention_chunk_size=8,
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.5,
            use_qk_norm=True,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=False,
        ),
    ),
}
