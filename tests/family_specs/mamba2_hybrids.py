"""Mamba 2 state space layers, alone or beside attention: Mamba 2 (attention-free), Granite 4
(``granitemoehybrid``: MoE with a shared MLP, or the shared MLP alone without rope; Granite's
multipliers), Nemotron-H (one mixer per block: Mamba, attention without rope, a squared-ReLU
MLP, sigmoid-routed MoE with groups; dt clamped below in prefill), Bamba, and Falcon-H1
(attention and Mamba in parallel in every layer, muP multipliers; with and without the
grouped norm of the Mamba output).
Off-default: several SSM groups, a conv kernel of 3, SSM head dims unlike the attention's,
biases, chunks of 8 or 16 that the test prompts cross.

transformers clamps dt to ``time_step_limit`` in its chunked scan only, not in its one-token
step (as warmboot does), so a preempted request computed again (its generated tokens now
prefill) differs from the reference wherever the limit binds: no spec sets a limit, and
Nemotron-H's fixed lower limit (``time_step_min``) moves the preempted prompt's logprobs by
about 5e-5 here."""

_ATTN = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
_FALCON_H1 = _ATTN | dict(
    num_hidden_layers=3,
    intermediate_size=56,
    mlp_bias=True,
    projectors_bias=True,
    mamba_d_ssm=96,
    mamba_n_heads=6,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=3,
    mamba_chunk_size=8,
    mamba_proj_bias=True,
    mamba_rms_norm=True,
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    mlp_multipliers=[1.5, 0.7],
    key_multiplier=0.8,
    attention_in_multiplier=1.2,
    attention_out_multiplier=0.9,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
    ssm_in_multiplier=1.1,
    ssm_out_multiplier=0.6,
    tie_word_embeddings=False,
)

SPECS = {
    "mamba2": (
        "Mamba2Config",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_heads=6,
            head_dim=16,
            n_groups=3,
            state_size=12,
            conv_kernel=3,
            chunk_size=16,
            use_bias=True,
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        _ATTN
        | dict(
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            intermediate_size=32,
            shared_intermediate_size=40,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=6,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=12,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            mamba_proj_bias=True,
            position_embedding_type="rope",
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=1.5,
            tie_word_embeddings=False,
        ),
    ),
    "granitemoehybrid_dense": (
        "GraniteMoeHybridConfig",
        _ATTN
        | dict(
            num_hidden_layers=3,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            num_local_experts=0,
            shared_intermediate_size=40,
            mamba_n_heads=4,
            mamba_n_groups=4,
            mamba_d_state=6,
            mamba_chunk_size=16,
            position_embedding_type="nope",
            residual_multiplier=0.7,
            tie_word_embeddings=True,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        _ATTN
        | dict(
            head_dim=16,
            hybrid_override_pattern="ME*-M",
            mamba_num_heads=4,
            mamba_head_dim=12,
            n_groups=2,
            ssm_state_size=10,
            conv_kernel=3,
            chunk_size=8,
            use_bias=True,
            mlp_bias=True,
            intermediate_size=56,
            n_routed_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            moe_shared_expert_intermediate_size=24,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            tie_word_embeddings=False,
        ),
    ),
    "bamba": (
        "BambaConfig",
        _ATTN
        | dict(
            num_hidden_layers=4,
            attn_layer_indices=[2],
            intermediate_size=56,
            mlp_bias=True,
            attention_bias=True,
            mamba_n_heads=4,
            mamba_d_head=24,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=3,
            mamba_chunk_size=16,
            # NOTE: transformers' Bamba numbers each call's tokens from 0 when no position_ids
            # are given (as the reference decode calls it): a rope slowed until positions do not
            # matter keeps that from the comparison.
            rope_parameters={"rope_type": "linear", "factor": 1e9, "rope_theta": 10000.0},
            tie_word_embeddings=True,
        ),
    ),
    "falcon_h1": ("FalconH1Config", _FALCON_H1),
    "falcon_h1_plain_gate": (
        "FalconH1Config",
        _FALCON_H1 | dict(mamba_rms_norm=False, mamba_n_groups=1, num_hidden_layers=2),
    ),
}
