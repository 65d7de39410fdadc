"""HY-V4: GLM-5's sparse indexed attention (full and shared indexer layers) under three
hyper-connection streams (an off-default ``hc_magnitude``), half-split rope in the latent
attention, the indexer's rope on its last dims, attention sinks, a gated attention output,
clamped SwiGLU experts (``swiglu_limit`` low enough to clamp), group-limited routing and
``mlp_layer_types`` with a dense layer after sparse ones. ``index_topk`` 6 against prompts of
up to 67 tokens; 32 indexer heads keep ReLU-zero ties rare."""

from tests.family_specs.deepseek import _MLA

SPECS = {
    "hy_v4": (
        "HYV4Config",
        {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
        | dict(
            num_hidden_layers=4,
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            indexer_types=["full", "shared", "full", "shared"],
            q_lora_rank=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
            index_topk=6,
            index_n_heads=32,
            index_head_dim=24,
            hc_mult=3,
            hc_magnitude=1.5,
            learnable_sink_init=0.3,
            swiglu_limit=1.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
