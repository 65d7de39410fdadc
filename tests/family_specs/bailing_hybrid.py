"""Ling's hybrid (``bailing_hybrid``): KDA state layers with full-rank gates (heads and head dim
of their own, a conv kernel of 3) beside gated latent attention, over DeepSeek-V3's MoE. One
with the bounded forget gate (a lower bound of -3), kinds from ``layer_group_size``, a dense
first layer, group-limited routing, two shared experts, attention biases; one with the softplus
gate, kinds listed (attention first, the dense layer last), yarn rope with ``mscale_all_dim``,
one group, not renormalised."""

_L, _F = "linear_attention", "full_attention"
_LING = dict(
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=4,  # NOTE: MLA expands every head's K/V; fewer KV heads break it
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    linear_num_heads=3,
    linear_head_dim=10,
    short_conv_kernel_size=3,
    intermediate_size=80,
    moe_intermediate_size=24,
    tie_word_embeddings=False,
)

SPECS = {
    "bailing_hybrid": (
        "BailingHybridConfig",
        _LING
        | dict(
            num_hidden_layers=3,
            layer_group_size=2,
            first_k_dense_replace=1,
            kda_lower_bound=-3.0,
            attention_bias=True,
            num_local_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            norm_topk_prob=True,
            routed_scaling_factor=1.7,
        ),
    ),
    "bailing_hybrid_softplus": (
        "BailingHybridConfig",
        _LING
        | dict(
            num_hidden_layers=2,
            layer_types=[_F, _L],
            mlp_layer_types=["sparse", "dense"],
            kda_safe_gate=False,
            num_local_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
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
        ),
    ),
}
