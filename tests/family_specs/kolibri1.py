"""Kolibri 1: sandwich norms, per-head q/k norms, a window the prompts cross with a NoPE
full layer between, and on every layer experts chosen by logits plus a correction bias,
weighted by their sigmoids (renormalised), beside an ungated shared MLP."""

SPECS = {
    "kolibri1": (
        "Kolibri1Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=20,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
    ),
}
