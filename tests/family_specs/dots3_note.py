"""dots3-note's text model: indexed layers (DeepSeek Sparse Attention, GLM-5's indexer) beside
sliding-window layers of their own latent-attention shape (``per_layer_config``: fewer heads,
other ranks, an 8-dim rope of another theta; their latent entry padded to the indexed layers'),
scaled query and KV latents, a normed rotated key part, one sigmoid gate a head, shared experts
of their own width and group-limited routing. ``index_topk`` 6 and a window of 8 against
prompts of up to 67 tokens; 32 indexer heads keep ReLU-zero ties rare."""

SPECS = {
    "dots3_note_text": (
        "Dots3NoteTextConfig",
        dict(
            hidden_size=64,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            layer_types=[
                "indexed_attention",
                "sliding_attention",
                "indexed_attention",
                "sliding_attention",
            ],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=12,
            head_dim=32,
            swa_num_attention_heads=2,
            swa_num_key_value_heads=2,
            swa_q_lora_rank=24,
            swa_kv_lora_rank=40,
            swa_head_dim=32,
            swa_qk_nope_head_dim=24,
            swa_v_head_dim=16,
            swa_rope_theta=500.0,
            sliding_window=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            shared_experts_intermediate_size=20,
            routed_scaling_factor=2.0,
            index_topk=6,
            index_n_heads=32,
            index_head_dim=24,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
