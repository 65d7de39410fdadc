"""GPT-OSS: attention sinks (HF init: noise of std ``initializer_range``), q/k/v/o biases,
sliding/full layers alternating with a window the prompts cross, yarn rope without
truncation (the ramp bounds fractional), a biased top-2 router over 6 experts and biased
experts (noise from ``_perturb``) whose SwiGLU clamp is low enough to bite. q is wider than
the hidden size."""

SPECS = {
    "gpt_oss": (
        "GptOssConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=10,
            swiglu_limit=1.5,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            tie_word_embeddings=False,
        ),
    ),
}
