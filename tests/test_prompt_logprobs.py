"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): computed in the prefill, equal
to transformers' ``log_softmax`` over the prompt (fp32), through chunked prefill, prefix-cache
hits, preemption, n > 1, both loops and every output kind."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_engine_clean, hf_logits, random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.outputs import OutputFolder

TOL = 1e-4


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(path, hf_model):
    """prompt -> (len, vocab) float64 log_softmax of transformers' logits."""
    model = hf_model(path)

    def ref(prompt: list[int]) -> torch.Tensor:
        return torch.log_softmax(hf_logits(model, prompt).double(), dim=-1)

    return ref


def make_llm(path, **kw) -> LLM:
    args = dict(max_model_len=128, block_size=4, num_kv_blocks=96, pipelined=False)
    return LLM(str(path), **(args | kw))


def check(prompt_lps, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """None first; then per token its own logprob and the top ``k``, as transformers has them."""
    assert prompt_lps is not None and len(prompt_lps) == len(prompt)
    assert prompt_lps[0] is None
    for i in range(1, len(prompt)):
        entries, row = prompt_lps[i], ref[i - 1]
        token = prompt[i]
        assert abs(entries[token].logprob - float(row[token])) < TOL, f"position {i}"
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entries), f"position {i}: top {top} not in {sorted(entries)}"
        assert len(entries) <= k + 1
        for t in top:
            assert abs(entries[t].logprob - float(row[t])) < TOL


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_match_transformers(path, reference, pipelined, budget):
    """``budget`` 7 forces chunked prefill: every chunk predicts the next chunk's first token."""
    llm = make_llm(path, pipelined=pipelined, max_num_batched_tokens=budget)
    prompts = random_prompts([40, 9, 2, 1], VOCAB_SIZE, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, prompt in zip(outs, prompts, strict=True):
        check(out.prompt_logprobs, prompt, reference(prompt), 2)
        assert len(out.outputs[0].token_ids) == 3
    assert_engine_clean(llm)


def test_a_cached_prefix_is_not_skipped(path, reference):
    """The prefix is in the cache (an earlier request computed it), yet every prompt token gets
    its logprob; the request's own blocks then serve later requests from the cache."""
    llm = make_llm(path)
    prompt = random_prompts([33], VOCAB_SIZE, seed=6)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": prompt[:24]}, plain)
    hits = llm.stats()["prefix_cache_hits"]
    (out,) = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    check(out.prompt_logprobs, prompt, reference(prompt), 0)
    assert out.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hits"] == hits
    (again,) = llm.generate({"prompt_token_ids": prompt}, plain)
    assert again.num_cached_tokens > 0
    assert_engine_clean(llm)


def test_preemption_and_siblings(path, reference):
    """A pool too small for the batch preempts requests mid-prompt; n=3 computes the prompt
    logprobs once and every output holds them once."""
    llm = make_llm(path, num_kv_blocks=40, max_num_batched_tokens=24)
    prompts = random_prompts([45, 40, 38, 30], VOCAB_SIZE, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats()["preemptions"] > 0, "precondition: the pool forced preemption"
    for out, prompt in zip(outs, prompts, strict=True):
        check(out.prompt_logprobs, prompt, reference(prompt), 1)
    prompt = prompts[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, prompt_logprobs=1))
    check(out.prompt_logprobs, prompt, reference(prompt), 1)
    assert len(out.outputs) == 3
    assert_engine_clean(llm)


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_streamed_outputs_carry_them(path, reference, kind):
    llm = make_llm(path)
    prompt = random_prompts([12], VOCAB_SIZE, seed=8)[0]
    params = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=0, output_kind=kind)
    outs = list(llm.generate_stream({"prompt_token_ids": prompt}, params))
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert outs[0].prompt_logprobs is not None, "complete before the first token"
    assert len(carrying) == (1 if kind == "delta" else len(outs))
    folder = OutputFolder()
    for o in outs:
        folder.add(o)
    check(folder.cumulative().prompt_logprobs, prompt, reference(prompt), 0)


def test_bad_values_are_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
