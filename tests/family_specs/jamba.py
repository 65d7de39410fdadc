"""Jamba: Mamba 1 layers (dt, B and C RMS-normalised with weights) beside attention layers
without rope, gated MLPs and softmax top-k experts (not renormalised).
Off-default: five layers with attention at 1 and 4 (``attn_layer_period`` 3, offset 1) and
experts at 0, 2 and 4 (period 2, offset 0), so both layer kinds come with and without
experts; a conv kernel of 3, a time-step rank of 5, in/out projection biases, an untied head.
The test prompts (up to 47 tokens, 16-token steps) cross the chunked prefill, each chunk
continuing from the saved conv window and scan state."""

SPECS = {
    "jamba": (
        "JambaConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=56,
            attn_layer_period=3,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=12,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_dt_rank=5,
            mamba_conv_bias=True,
            mamba_proj_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
