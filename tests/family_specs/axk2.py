"""A.X-K2: DeepSeek-V3.2's sparse indexed attention with a fused query/gate projection (the
attention output gated per head), gated RMSNorms (every input norm, the sparse layers'
post-attention norms), routing without expert groups (A.X-K2-Light's null ``n_group``) and
``mlp_layer_types`` with a dense layer after a sparse one. ``index_topk`` 6 against prompts of
up to 67 tokens; 32 indexer heads keep ReLU-zero ties rare."""

from tests.family_specs.deepseek import _MLA

SPECS = {
    "axk2": (
        "AXK2Config",
        {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
        | dict(
            num_hidden_layers=3,
            mlp_layer_types=["dense", "sparse", "dense"],
            q_lora_rank=32,
            gated_norm_rank=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=None,
            topk_group=None,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            index_topk=6,
            index_n_heads=32,
            index_head_dim=24,
            tie_word_embeddings=False,
        ),
    ),
}
