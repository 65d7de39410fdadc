"""Hybrids of gated DeltaNet and gated full attention: Qwen3-Next (MoE with a gated shared
expert, a dense layer from ``mlp_only_layers``, projections grouped by key head), Qwen3.5
(dense, separate projections) and Qwen3.5-MoE. Off-default: more value heads than key heads,
key and value head dims that differ, a conv kernel of 3, partial rotary, layer kinds listed."""

_L, _F = "linear_attention", "full_attention"
# NOTE: deeper stacks of random DeltaNet layers are ill-conditioned: transformers' own prefill
# and cached decode of 4 layers [L, F, L, L] differ by 2.9e-4 in logprob (these: <= 5e-5)
_HYBRID = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=3,
    num_hidden_layers=4,
    layer_types=[_L, _F, _L, _F],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)
_MOE = dict(
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
)

SPECS = {
    "qwen3_next": (
        "Qwen3NextConfig",
        _HYBRID | _MOE | dict(norm_topk_prob=False, mlp_only_layers=[2]),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        _HYBRID | dict(num_hidden_layers=3, layer_types=[_L, _L, _F], tie_word_embeddings=True),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        _HYBRID | _MOE | dict(num_hidden_layers=2, layer_types=[_L, _F], num_experts=8),
    ),
}
