"""The canary: greedy tokens, with their logprobs, of a fixed prompt. A snapshot records it
at the boot that made it; a restore (tier A: the image's weights; tier P: the whole process)
must reproduce it, or it is not used. Wrong weights that pass every hash (a consistent but
wrong manifest) still fail here. Torch-free: the launcher compares canaries too."""

from __future__ import annotations

from collections.abc import Sequence

from warmboot.sampling_params import SamplingParams

CANARY_PROMPT = (1, 2, 3, 4, 5, 6, 7)
"""NOTE: not token 0, often a padding token whose zero embedding would make the canary blind."""
CANARY_TOKENS = 2
"""One prefill (every weight) and one decode step (the paged path); each more token cost a
tier-P start ~0.14 s under gVisor for the 0.49B model."""
CANARY_RTOL = 1e-3
"""Logprobs agree to this, relative (absolute below 1). Bitwise on the same host in practice;
the slack covers a kernel that picks another reduction order after a restore."""
HALF_ATOL = 1 / 16
"""For a bf16 or fp16 engine restoring a tier-A image, logprobs agree to this, absolute: one
bf16 step of a logit in [8, 16). The image may come from another process whose torch kernels
ran another instruction set: gVisor's CPUID hides AVX-512 BF16 from oneDNN, whose bf16 GEMM
serves SDPA's prefill, and a 1.5B model's canary logit landed one step (0.0156) away. Wrong
weights move logprobs by whole nats, and the tokens must still match."""


def canary_mismatch(recorded: Sequence, fresh: Sequence, atol: float = 0.0) -> str | None:
    """None when ``fresh`` reproduces ``recorded`` (same tokens, logprobs within
    ``CANARY_RTOL`` or ``atol``); otherwise what differs."""
    if len(recorded) != len(fresh):
        return f"canary has {len(fresh)} tokens, {len(recorded)} were recorded"
    for i, (want, got) in enumerate(zip(recorded, fresh, strict=True)):
        (wt, wlp), (t, lp) = (int(want[0]), float(want[1])), (int(got[0]), float(got[1]))
        if t != wt:
            return f"canary token {i} is {t}, {wt} was recorded"
        if abs(lp - wlp) > max(CANARY_RTOL * max(1.0, abs(wlp)), atol):
            return f"canary logprob {i} is {lp:.6g}, {wlp:.6g} was recorded"
    return None


def run_canary(engine) -> list[tuple[int, float]]:
    """Greedy tokens with logprobs of the canary prompt, run alone on an idle engine and then
    forgotten. It is also the warm-up: one real request through every part."""
    params = SamplingParams(
        max_tokens=CANARY_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=1,
        output_kind="final",
    )
    engine.add_request("canary", {"prompt_token_ids": list(CANARY_PROMPT)}, params)
    out = None
    while engine.has_unfinished_requests():
        out = next(iter(engine.step()), out)
    engine.block_manager.reset_prefix_cache()
    c = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
