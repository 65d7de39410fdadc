"""ERNIE 4.5 MoE: the dense family's interleaved float32 rope and biases over MoE blocks
routed in float32 (softmax, a correction bias on the choice, renormalised), with shared
experts; a dense first layer (``moe_layer_start_index``), a biased head, untied."""

SPECS = {
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=72,
            moe_intermediate_size=24,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            use_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
