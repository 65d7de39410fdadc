"""Mixtures of experts with softmax routing: Mixtral (renormalised top-2 of 6, windows),
Qwen2-MoE (shared expert behind a sigmoid gate, a dense layer from ``mlp_only_layers``,
top-3 not renormalised), Qwen3-MoE (q/k norm, renormalised),
OLMoE (q/k norm over the whole projection), FlexOlmo (OLMo 2 over MoE blocks). Eight
experts or fewer and short steps: some experts get no token in a step."""

_SHAPE = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)

SPECS = {
    "mixtral": (
        "MixtralConfig",
        _SHAPE
        | dict(
            num_hidden_layers=2,
            intermediate_size=40,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=24,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        _SHAPE
        | dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        _SHAPE
        | dict(
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        _SHAPE
        | dict(
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
}

SPECS["flex_olmo"] = (
    "FlexOlmoConfig",
    _SHAPE
    | dict(
        num_hidden_layers=2,
        intermediate_size=32,
        num_experts=7,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
)

# Granite-MoE: top-k of the logits, then softmax; multipliers; -Shared adds a shared MLP
_GRANITE = dict(
    num_hidden_layers=2,
    intermediate_size=32,
    num_local_experts=6,
    num_experts_per_tok=2,
    embedding_multiplier=3.0,
    residual_multiplier=0.6,
    attention_multiplier=0.09,
    logits_scaling=2.5,
    tie_word_embeddings=False,
)
SPECS["granitemoe"] = ("GraniteMoeConfig", _SHAPE | _GRANITE)
SPECS["granitemoeshared"] = (
    "GraniteMoeSharedConfig",
    _SHAPE | _GRANITE | dict(shared_intermediate_size=40, num_experts_per_tok=3),
)
