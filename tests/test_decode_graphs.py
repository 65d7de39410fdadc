"""Decode steps through the CUDA-graph path: static buffers, bucket padding, scratch block.

Without a GPU the graphs are emulated (the same static buffers, padding and stale table
columns, the forward run eagerly instead of replayed), so everything but the capture itself
is checked here; bench/gpu_check.py checks the captured graphs on a GPU.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import example, given

from tests.helpers import CaptureGuard, guard_captured_region, hf_greedy, random_prompts
from tests.test_pipelined import (
    HEAVY,
    MAX_MODEL_LEN,
    _build,
    compare_runs,
    drive,
    greedy,
    greedy_reference,
    make_llm,
    workload_settings,
    workloads,
)
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM
from warmboot.device.graphs import DecodeGraphs, default_batch_sizes


@pytest.fixture(scope="module", autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def graph_llm(path, pipelined: bool, sizes=(1, 2, 4, 8), **kw) -> LLM:
    llm = make_llm(path, pipelined, **kw)
    llm.engine.enable_decode_graphs(sizes, emulate=True)
    return llm


def test_default_batch_sizes():
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(6) == (1, 2, 4, 6)
    assert default_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)


def test_bucket_and_argument_checks():
    def fwd(ids, positions, meta):
        return torch.zeros(ids.shape[0], 3)

    cpu = torch.device("cpu")
    g = DecodeGraphs(fwd, cpu, (8, 1, 4, 2), 5, 16, 99, emulate=True)
    assert g.batch_sizes == (1, 2, 4, 8)
    assert [g.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert g.slot_mapping.tolist() == [99 * 16] * 8  # every row starts as padding
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(fwd, cpu, (1,), 5, 16, 99)
    with pytest.raises(ValueError, match=">= 1"):
        DecodeGraphs(fwd, cpu, (0, 2), 5, 16, 99, emulate=True)


def test_cuda_graphs_on_cpu_is_refused(path):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        make_llm(path, pipelined=False, cuda_graphs=True)


@pytest.mark.parametrize("pipelined", [False, True])
def test_graph_steps_match_transformers(path, hf, pipelined):
    """Batches of 1..5 rows (buckets 1, 2, 4, 8: padded) as requests finish at different
    lengths; greedy tokens equal transformers', the scratch block is never managed."""
    llm = graph_llm(path, pipelined)
    engine = llm.engine
    assert engine.runner.scratch_block == engine.block_manager.num_blocks
    prompts = random_prompts([5, 9, 3, 14, 7], VOCAB_SIZE, seed=3)
    lengths = [4, 11, 7, 16, 2]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy(n, ignore_eos=True) for n in lengths],
    )
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n)
    replays = engine.runner.graphs.replays
    assert {1, 2, 4, 8} <= set(replays), replays  # every bucket ran, 3 and 5 rows padded
    assert llm.stats()["graph_steps"] == sum(replays.values())


def test_graphs_equal_eager_on_random_workloads(path):
    """The random workloads of the pipelined tests (preemption, aborts, stop strings, n > 1,
    seeded sampling, penalties, logprobs): the eager sync loop against the pipelined loop
    with graphs, identical outputs and a clean pool afterwards."""
    tok, greedy_ref = greedy_reference(path)
    seen: Counter = Counter()

    @workload_settings(6)
    @given(workloads())
    @example(HEAVY)
    def check(workload):
        specs, engine_kw = workload
        reqs = [_build(s, greedy_ref) for s in specs]
        eager = drive(make_llm(path, False, max_model_len=MAX_MODEL_LEN, **engine_kw), reqs)
        sizes = (1, 2, 4) if engine_kw["max_num_seqs"] < 8 else (1, 4, 8)
        llm = graph_llm(path, True, sizes, max_model_len=MAX_MODEL_LEN, **engine_kw)
        graphed = drive(llm, reqs)
        seen["graph_steps"] += llm.stats()["graph_steps"]
        seen.update(compare_runs(reqs, eager, graphed, tok))

    check()
    assert seen["graph_steps"] > 50 and seen["aborted"] > 0, seen


def test_stale_table_columns_and_resize(path, hf):
    """A long request leaves wide block tables in the static buffers; a short one later reads
    the same bucket (stale columns past its length). After ``resize_kv_cache`` the graphs
    are set up again for the new pool and still answer the same."""
    llm = graph_llm(path, pipelined=False, sizes=(1, 2))
    long, short = random_prompts([60, 4], VOCAB_SIZE, seed=8)
    expect_short = hf_greedy(hf, short, 6)
    out = llm.generate({"prompt_token_ids": long}, greedy(30, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, long, 30)
    width = llm.engine.runner.graphs.block_tables[0].tolist()
    assert len(set(width)) > 5  # the long request's blocks are still in the buffer
    out = llm.generate({"prompt_token_ids": short}, greedy(6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expect_short
    old = llm.engine.runner.graphs
    llm.engine.resize_kv_cache(40)
    graphs = llm.engine.runner.graphs
    assert graphs is not old and graphs.scratch_block == 40 == llm.engine.runner.scratch_block
    out = llm.generate({"prompt_token_ids": short}, greedy(6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expect_short
    assert graphs.replays[1] == 5


def test_padding_rows_write_only_the_scratch_block(path):
    """Rows padded into a bucket write K/V at the scratch slot only: with the whole pool
    poisoned beforehand, the blocks written are the requests' and the scratch block."""
    llm = graph_llm(path, pipelined=True, sizes=(8,))
    runner = llm.engine.runner
    for k_cache, v_cache in runner.kv_caches:
        k_cache.fill_(7.0)
        v_cache.fill_(7.0)
    prompts = random_prompts([6, 10, 3], VOCAB_SIZE, seed=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8, ignore_eos=True))
    assert runner.graphs.replays[8] > 0
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            written = (cache.flatten(1) != 7.0).any(dim=1)
            assert written[runner.scratch_block]  # the padding rows wrote here
            # 3 requests of at most 18 tokens in 4-token blocks: at most 5 blocks apiece
            assert 0 < int(written[: runner.scratch_block].sum()) <= 15


def test_a_failed_capture_falls_back_to_eager_unless_required(path, monkeypatch):
    llm = make_llm(path, pipelined=False)
    engine = llm.engine
    assert llm.stats()["cuda_graphs"] == "off"

    def broken(*args, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.runner, "setup_decode_graphs", broken)
    engine.startup.capture_graphs(engine, required=False)
    assert engine.runner.graphs is None
    assert llm.stats()["cuda_graphs"].startswith("off: capture failed: RuntimeError")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3  # still serves, eagerly
    with pytest.raises(RuntimeError, match="stream is capturing"):
        engine.startup.capture_graphs(engine, required=True)
    monkeypatch.undo()
    engine.enable_decode_graphs((1, 2), emulate=True)
    assert llm.stats()["cuda_graphs"] == "emulated"


def test_a_smaller_kv_pool_leaves_no_stale_block_ids(path):
    """Rows of the per-slot block tables hold ids past a row's length, which the torch
    backend reads (masked); after the pool shrinks (as before a process checkpoint) none
    may point past the new pool, or a short row next to a long one would index past it."""
    llm = make_llm(path, pipelined=False, num_kv_blocks=64)
    many = random_prompts([30] * 4, VOCAB_SIZE, seed=9)
    llm.generate([{"prompt_token_ids": p} for p in many], greedy(20, ignore_eos=True))
    runner = llm.engine.runner
    tables = runner.inputs.host_tables
    assert tables[:-1].max() >= 20
    llm.engine.resize_kv_cache(20)
    tables = runner.inputs.host_tables
    assert tables[:-1].max() == 0 and tables[-1].min() == 20
    long, short = random_prompts([30, 3], VOCAB_SIZE, seed=10)
    prompts = [{"prompt_token_ids": p} for p in (long, short)]
    out = llm.generate(prompts, greedy(5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]


def test_the_captured_forward_has_no_capture_breaking_ops(path, monkeypatch):
    """What a graph captures (the torch backend's decode forward) never reads device data on
    the host nor makes data-dependent shapes: on CUDA either breaks the capture."""
    guard = guard_captured_region(monkeypatch)
    llm = graph_llm(path, pipelined=True)
    prompts = random_prompts([9, 4, 13], VOCAB_SIZE, seed=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(5, ignore_eos=True))
    assert llm.stats()["graph_steps"] >= 4 and guard.ops > 100
    assert guard.hits == []


def test_capture_guard_flags_host_reads():
    t = torch.arange(6)
    with CaptureGuard() as guard:
        int(t[2])
        with torch.inference_mode():
            t[3].item()
        t[t > 2]
        torch.repeat_interleave(t, t)
        torch.nonzero(t)
        t[torch.tensor([1, 2])]  # an integer index is fine
    assert len(guard.hits) == 5, guard.hits
