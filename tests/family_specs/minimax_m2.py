"""MiniMax-M2: q/k RMSNorms over the whole projections, rope on part of each head
(``rotary_dim``), and sigmoid routing with a correction bias on the choice, renormalised."""

SPECS = {
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rotary_dim=8,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
}
