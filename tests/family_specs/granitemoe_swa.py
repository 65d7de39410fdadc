"""Granite-MoE SWA: attention sinks, windowed layers the prompts cross beside a full first
layer, a NoPE layer and two rope bases, Granite's multipliers, top-k-then-softmax experts
and a shared MLP."""

SPECS = {
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=24,
            shared_intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_rope_theta=[10000.0, 0, 500.0],
            embedding_multiplier=2.0,
            residual_multiplier=0.7,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            tie_word_embeddings=False,
        ),
    ),
}
