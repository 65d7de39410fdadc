"""MiniMax: lightning attention (linear attention with a per-head decay that weakens with
depth) beside windowed GQA softmax attention, Mixtral's MoE in every layer, residuals taken
after the norms and scaled. Off-default: the layer kinds ([F, L, L]; transformers' default
alternates), a head_dim not hidden / heads, every alpha/beta factor, a window the prompts
cross, an untied head. The first layer attends: transformers' cached decode counts positions
from layer 0's KV, so a lightning layer 0 would give its decode wrong positions."""

_F, _L = "full_attention", "linear_attention"

SPECS = {
    "minimax": (
        "MiniMaxConfig",
        dict(
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            layer_types=[_F, _L, _L],
            intermediate_size=40,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=12,
            full_attn_alpha_factor=1.5,
            full_attn_beta_factor=0.8,
            linear_attn_alpha_factor=1.3,
            linear_attn_beta_factor=0.7,
            mlp_alpha_factor=1.2,
            mlp_beta_factor=0.9,
            tie_word_embeddings=False,
        ),
    ),
}
