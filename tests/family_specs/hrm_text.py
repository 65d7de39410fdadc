"""HRM-Text: two weight-tied stacks run as a fixed recurrence (2 H cycles of 2 L-stack calls
then an H-stack call: 12 engine layers over 2 layers a stack, each with a KV cache of its
own), the streams z_H and z_L in one row. Off defaults: the cycle counts, a head size
unlike hidden / heads, biases everywhere, a set embedding scale, a non-zero ``z_L_init``
(``tests.tiny_models``' perturbation)."""

SPECS = {
    "hrm_text": (
        "HrmTextConfig",
        dict(
            hidden_size=40,
            num_hidden_layers=2,  # NOTE: a stack's (saved: 12, and num_layers_per_stack 2)
            num_attention_heads=4,
            head_dim=12,
            intermediate_size=72,
            H_cycles=2,
            L_cycles=2,
            embedding_scale=2.5,
            attention_bias=True,
            mlp_bias=True,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
