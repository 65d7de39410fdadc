"""Mamba 1 attention-free: Mamba (``MambaForCausalLM``) and FalconMamba (dt, B and C
RMS-normalised without weights).
Off-default: a conv kernel of 3, a time-step rank of 5 (not ``hidden / 16``), in/out
projection biases; Mamba with its tied head and the residual in float32, FalconMamba untied
with the residual in the model's dtype and its own ``mixer_rms_eps``. The test prompts (up to
47 tokens, 16-token steps) cross the chunked prefill, each chunk continuing from the saved
conv window and scan state."""

_MAMBA = dict(
    hidden_size=48,
    num_hidden_layers=3,
    state_size=12,
    expand=2,
    conv_kernel=3,
    time_step_rank=5,
    use_bias=True,
    use_conv_bias=True,
)

SPECS = {
    "mamba": ("MambaConfig", _MAMBA | dict(tie_word_embeddings=True)),
    "falcon_mamba": (
        "FalconMambaConfig",
        _MAMBA
        | dict(
            num_hidden_layers=2,
            residual_in_fp32=False,
            mixer_rms_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
