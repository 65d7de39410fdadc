"""Kimi Linear: Kimi Delta Attention state layers (several heads, a conv kernel of 3) beside
latent attention without rope, over DeepSeek-V3's MoE. One with a full-rank query, a dense
first layer, group-limited routing (two groups, one kept), renormalised; one with a
low-rank query, attention biases, the dense layer last, two shared experts, one group, not
renormalised."""

_L, _F = "linear_attention", "full_attention"
_KIMI = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=4,  # NOTE: MLA expands every head's K/V; fewer KV heads break it
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    linear_num_heads=3,
    linear_head_dim=10,
    linear_conv_kernel_dim=3,
    intermediate_size=80,
    moe_intermediate_size=24,
    tie_word_embeddings=False,
)

SPECS = {
    "kimi_linear": (
        "KimiLinearConfig",
        _KIMI
        | dict(
            num_hidden_layers=3,
            layer_types=[_L, _F, _L],
            mlp_layer_types=["dense", "sparse", "sparse"],
            q_lora_rank=None,
            num_local_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.7,
        ),
    ),
    "kimi_linear_qlora": (
        "KimiLinearConfig",
        _KIMI
        | dict(
            num_hidden_layers=2,
            layer_types=[_F, _L],
            mlp_layer_types=["sparse", "dense"],
            q_lora_rank=20,
            attention_bias=True,
            num_local_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
        ),
    ),
}
