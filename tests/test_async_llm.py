"""The asyncio front: concurrent streams, cancellation, bad requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import hf_greedy, random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.engine.async_llm import AsyncLLM
from warmboot.engine.llm_engine import InvalidRequestError


@pytest.fixture
def async_llm(path):
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=96, cpu_threads=1)
    front = AsyncLLM(llm.engine)
    yield front
    front.shutdown()


def _wait_idle(front: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while front.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not front.engine.has_unfinished_requests()
    front.engine.block_manager.check_invariants()
    assert front.engine.block_manager.num_used_blocks == 0


async def _collect(front, prompt, params, request_id=None):
    deltas, last = [], None
    async for out in front.generate(prompt, params, request_id):
        deltas.append(out.outputs[0].delta_token_ids)
        last = out
    return deltas, last


def test_concurrent_streams_match_transformers(async_llm, hf):
    prompts = random_prompts((7, 19, 3, 30), VOCAB_SIZE, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        jobs = [_collect(async_llm, {"prompt_token_ids": p}, params) for p in prompts]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for prompt, (deltas, last) in zip(prompts, results, strict=True):
        expected = hf_greedy(hf, prompt, 12)
        assert last.finished and last.outputs[0].token_ids == expected
        assert [t for d in deltas for t in d] == expected
        assert len(deltas) > 1, "outputs must stream, not arrive at once"
    _wait_idle(async_llm)


def test_consumer_that_stops_early_aborts_its_request(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params):
            seen += 1
            if seen == 3:
                break  # the client went away
        return seen

    assert asyncio.run(main()) == 3
    _wait_idle(async_llm)


def test_bad_request_raises_for_its_caller_only(async_llm, hf):
    good = random_prompts((9,), VOCAB_SIZE, seed=22)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        ok = asyncio.create_task(_collect(async_llm, {"prompt_token_ids": good}, params))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await _collect(async_llm, {"prompt_token_ids": [1] * 200}, params)
        with pytest.raises(InvalidRequestError, match="empty"):
            await _collect(async_llm, "", params)
        return await ok

    _, last = asyncio.run(main())
    assert last.outputs[0].token_ids == hf_greedy(hf, good, 8)
    _wait_idle(async_llm)


def test_duplicate_request_id_is_reported_to_the_second_caller(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        first = asyncio.create_task(_collect(async_llm, [3, 4, 5], params, "same"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _collect(async_llm, [3, 4, 5], params, "same")
        return await first

    _, last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 100
    _wait_idle(async_llm)
