"""DeepSeek-V3.2 and GLM-5: V3's latent attention and routing with DeepSeek Sparse Attention.
``index_topk`` 6 against prompts of up to 67 tokens: from the seventh position on every query
attends to a selection. 32 indexer heads make ties of index scores (all heads' scores cut
to zero by the ReLU) rare. V3.2: the indexer's half-split rope, an explicit
``mlp_layer_types`` (a dense layer after a sparse one); GLM-5: interleaved rope in the indexer,
``shared`` layers reusing the last full layer's selection."""

from tests.family_specs.deepseek import _MLA

_DSA = _MLA | dict(
    q_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.0,
    index_topk=6,
    index_n_heads=32,
    index_head_dim=24,
    tie_word_embeddings=False,
)

SPECS = {
    "deepseek_v32": (
        "DeepseekV32Config",
        _DSA | dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "dense"]),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        _DSA | dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]),
    ),
}
