"""Zamba 2: Mamba 2 layers and shared transformer blocks fed (residual, embeddings).
Off-default: two shared blocks over three hybrid layers (the first block called twice, its
weights stored once), small LoRA adapters on q/k/v and gate/up, rope in the shared attention,
biases on the Mamba and MLP projections, two SSM groups, a conv kernel of 3 and chunks of 8
that the test prompts cross; then one block, no q/k/v adapters, NoPE and grouped K/V heads.

dt is clamped below at ``time_step_min`` in transformers' chunked scan only (as for
Nemotron-H, ``mamba2_hybrids``): a tiny minimum keeps the limit from binding, so a preempted
request computed again matches; ``time_step_floor`` keeps the initial dt biases large enough
for the state to matter."""

_DT = dict(time_step_min=1e-9, time_step_max=0.5, time_step_floor=0.05)
_BASE = _DT | dict(
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=40,
    n_mamba_heads=4,
    mamba_d_state=8,
    chunk_size=8,
)

SPECS = {
    "zamba2": (
        "Zamba2Config",
        _BASE
        | dict(
            num_hidden_layers=6,
            layers_block_type=["mamba", "hybrid", "linear_attention", "hybrid", "hybrid", "mamba"],
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=4,
            use_mem_rope=True,
            add_bias_linear=True,
            mamba_ngroups=2,
            mamba_d_conv=3,
        ),
    ),
    "zamba2_plain": (
        "Zamba2Config",
        _BASE
        | dict(
            num_hidden_layers=4,
            layers_block_type=["hybrid", "linear_attention", "hybrid", "linear_attention"],
            num_key_value_heads=2,
            adapter_rank=6,
            hidden_act="gelu_pytorch_tanh",
            chunk_size=16,
            tie_word_embeddings=False,
        ),
    ),
}
