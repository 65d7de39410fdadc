"""Length-dependent ropes (``models.layers.rope``): longrope and dynamic NTK rotate a prompt
longer than their limit (18 here) by its length, as transformers does. Prompts below, at and
past the limit, each prefilled in one step here (chunked in ``test_families``), one after
another so each could reuse the one before's blocks: greedy tokens and logprobs as
transformers', and the prefix cache shares blocks only between requests rotated alike."""

from __future__ import annotations

import pytest

from tests.helpers import random_prompts
from tests.test_families import LOGPROB_TOL, hf_greedy_logprobs
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams

MAX_NEW = 8


def _prompts() -> list[list[int]]:
    """A long prompt, one below the limit and one at it sharing its first blocks, and one
    past it that extends it."""
    (first, extra) = random_prompts([30, 5], VOCAB_SIZE, seed=5)
    return [first, first[:12] + extra[:4], first[:18], first + extra]


@pytest.mark.parametrize(
    ("kind", "hits"),
    [("phi3_longrope", 2), ("llama_dynamic", 1)],
    ids=["longrope-long-prompts-share", "dynamic-each-length-its-own"],
)
def test_long_prompts_rotate_as_transformers_and_share_only_alike(
    kind, hits, tiny_model_dir, hf_model
):
    path = tiny_model_dir(kind)
    hf, prompts = hf_model(path), _prompts()
    llm = LLM(str(path), max_model_len=64, block_size=4, enforce_eager=True, pipelined=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        want, want_lps = hf_greedy_logprobs(hf, prompt, MAX_NEW)
        got = out.outputs[0]
        assert got.token_ids == want, f"{kind}: prompt {i} ({len(prompt)} tokens) differs"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < LOGPROB_TOL
    # NOTE: the third (at the limit) reuses the second's blocks (both short), never the
    # first's; longrope: the fourth (long) reuses the first's; dynamic: each long prompt is
    # rotated by its own length, so no long one shares
    assert llm.stats()["prefix_cache_hits"] == hits
