"""DeepSeek-V2 and V3: multi-head latent attention over a latent KV cache, MoE after dense
first layers, shared experts. V3 with a low-rank query, yarn rope with ``mscale_all_dim``
(the softmax scale), interleaved rope, group-limited sigmoid routing, renormalised; V3 with a
full-rank query, rope halves (``rope_interleave: false``), one group, not renormalised,
attention biases; V2 with softmax routing limited to groups, two shared experts, a tied head,
every layer sparse.
The latent entry is 48 + 16 = 64 wide (a power of two: the Triton kernels' test size)."""

_MLA = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,  # NOTE: transformers' V3 default (128) breaks its own attention
    kv_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=12,
    intermediate_size=80,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
)

SPECS = {
    "deepseek_v3": (
        "DeepseekV3Config",
        _MLA
        | dict(
            num_hidden_layers=3,
            q_lora_rank=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
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
    "deepseek_v3_plain": (
        "DeepseekV3Config",
        _MLA
        | dict(
            num_hidden_layers=2,
            q_lora_rank=None,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        _MLA
        | dict(
            num_hidden_layers=2,
            first_k_dense_replace=0,
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
            tie_word_embeddings=True,
        ),
    ),
}
