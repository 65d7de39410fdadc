"""The engine against transformers on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_engine_clean, hf_greedy, hf_logits, random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.core.types import ScheduledRequest

pytestmark = pytest.mark.usefixtures("step_mode")  # compiled steps, then enforce_eager

LENGTHS = (5, 13, 31, 47, 2, 20)
MAX_NEW = 24


def _prompts(seed: int = 0) -> list[list[int]]:
    prompts = random_prompts(LENGTHS, VOCAB_SIZE, seed)
    # Two prompts that share a 20-token prefix with the fourth, for prefix caching.
    prompts.append(prompts[3][:20] + random_prompts([9], VOCAB_SIZE, seed + 1)[0])
    prompts.append(prompts[3][:20] + random_prompts([3], VOCAB_SIZE, seed + 2)[0])
    return prompts


def _engine_logits(llm: LLM, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Run ``token_ids`` through the paged runner ``chunk`` tokens at a time; all logits."""
    eng = llm.engine
    kv, runner = eng.block_manager, eng.runner
    assert kv.allocate("probe", len(token_ids))
    table = kv.block_table("probe")
    params = SamplingParams()
    logits = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start : start + chunk]
        s = ScheduledRequest("probe", ids, start, table, False, params, tuple(token_ids))
        logits.append(runner.forward_all([s]))
    kv.free("probe")
    return torch.cat(logits)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fp32_logits_match_transformers(kind, chunk, tiny_model_dir, hf_model):
    path = tiny_model_dir(kind)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64)
    tokens = random_prompts([40], VOCAB_SIZE, seed=3)[0]
    ours = _engine_logits(llm, tokens, chunk)
    ref = hf_logits(hf_model(path), tokens)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{kind}: max relative logit error {rel:.2e}"


def test_greedy_matches_transformers_with_everything_forced(kind, tiny_model_dir, hf_model):
    """Continuous batching, chunked prefill, prefix sharing and preemption all happen."""
    path = tiny_model_dir(kind)
    prompts = _prompts()
    ref = [hf_greedy(hf_model(path), p, MAX_NEW) for p in prompts]
    # 40 blocks x 4 tokens cannot hold all 8 sequences (up to 71 tokens each): preemption.
    llm = LLM(
        str(path),
        max_model_len=128,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
        max_num_seqs=5,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, expected) in enumerate(zip(outs, ref, strict=True)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == expected, f"{kind}: prompt {i} differs"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["prefix_cache_hits"] > 0, "the shared prefix should have hit the cache"
    assert_engine_clean(llm)


def test_staggered_arrivals_match_transformers(tiny_model_dir, hf_model):
    """Requests join a running batch at different steps (continuous batching)."""
    path = tiny_model_dir("llama")
    prompts = random_prompts((9, 25, 4, 17), VOCAB_SIZE, seed=7)
    ref = [hf_greedy(hf_model(path), p, 16) for p in prompts]
    llm = LLM(str(path), max_model_len=128, block_size=8, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results, step = {}, 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[f"r{i}"] for i in range(len(prompts))] == ref
    assert_engine_clean(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_reference(dtype, tiny_model_dir, hf_model):
    path = tiny_model_dir("qwen2", dtype)
    llm = LLM(str(path), dtype=dtype, max_model_len=128, block_size=4, num_kv_blocks=64)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    tokens = random_prompts([30], VOCAB_SIZE, seed=5)[0]
    ours = _engine_logits(llm, tokens, 8)
    ref = hf_logits(hf_model(path), tokens)  # float32 reference of the same weights
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 3e-2, f"{dtype}: relative logit error {rel:.2e}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.9


def test_n_completions_share_the_prompt_blocks(tiny_model_dir, hf_model):
    path = tiny_model_dir("llama")
    prompt = random_prompts([37], VOCAB_SIZE, seed=9)[0]
    ref = hf_greedy(hf_model(path), prompt, 10)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True),
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == ref for c in out.outputs)
    # Siblings found the 9 full prompt blocks of the first completion in the cache.
    assert llm.stats()["prefix_cache_hits"] >= 2
    seeded = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
    )[0]
    texts = {tuple(c.token_ids) for c in seeded.outputs}
    assert len(texts) == 3, "different completions of one seeded request must differ"
    assert_engine_clean(llm)


def test_compiled_steps_trace_once_for_every_batch_shape(step_mode, tiny_model_dir, hf_model):
    """Decode, prefill and mixed steps of any row count run the two graphs compiled at
    start-up (no recompile while serving); greedy tokens still match transformers."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=256)
    info = llm.engine.stats()["compile"]
    assert info["compiled"] is (step_mode == "compiled")
    if step_mode == "eager":
        return
    assert info["graphs"] == 2 and "compile" in llm.engine.startup_times
    prompts = random_prompts([1, 3, 17, 5, 30, 2, 9], VOCAB_SIZE, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert llm.engine.stats()["compile"]["graphs"] == 2, "a step recompiled while serving"
