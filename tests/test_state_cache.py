"""The state cache of hybrid models (state layers beside attention) on Qwen3.5's tiny
checkpoint (two gated DeltaNet layers, one gated attention layer): the memory it declares, a
long prompt through many chunks, that the family check fails when the state is dropped or
misordered, refusals of inconsistent configs, and tier-A restores of hybrids."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import warmboot.device.runner as runner_module
from tests.helpers import assert_engine_clean, random_prompts
from tests.test_families import LOGPROB_TOL, _prompts, hf_greedy_logprobs
from tests.test_model_loading import _copy, _edit_config, _serve
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.device.inputs import InputBuilder
from warmboot.device.pools import StateMoves

KIND = "qwen3_5"
CHUNK = 16


def _llm(path, **kwargs) -> LLM:
    options = dict(
        max_model_len=96,
        block_size=4,
        num_kv_blocks=200,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        enforce_eager=True,
        pipelined=False,
    )
    return LLM(str(path), **(options | kwargs))


def _greedy(llm: LLM, prompts: list[list[int]], max_new: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, tok, strict=True)]
        for o, tok in zip(outs, tokens, strict=True)
    ]
    return tokens, lps


def test_the_state_does_not_grow_with_the_context(tiny_model_dir):
    """KV bytes per token count the attention layer only; the state layers' bytes per request
    are their conv windows and float32 delta-rule matrices, whatever the context."""
    llm = _llm(tiny_model_dir(KIND))
    stats = llm.stats()
    kv_heads, head_dim = 2, 16
    assert stats["kv_bytes_per_token"] == 1 * 2 * kv_heads * head_dim * 4
    conv = (2 * 2 * 8 + 4 * 12) * (3 - 1) * 4  # (q, k, v channels) x (kernel - 1), float32 model
    recurrent = 4 * 8 * 12 * 4  # value heads x Dk x Dv, float32
    assert stats["state_bytes_per_request"] == 2 * (conv + recurrent)
    assert stats["state_slots_total"] == 2 * 4 + 2  # NOTE: one per request slot
    assert stats["prefix_caching_off"] is None and stats["state_checkpoints_total"] == 2 * 4


@pytest.mark.parametrize(
    ("chunk", "mode"),
    [
        (CHUNK, dict(enforce_eager=True, pipelined=False)),
        (128, dict(enforce_eager=False, pipelined=True)),
    ],
    ids=["16-token-chunks-eager-sync", "128-token-chunks-compiled-pipelined"],
)
def test_a_long_prompt_through_many_chunks_matches_transformers(
    chunk, mode, tiny_model_dir, hf_model
):
    """A prompt 16 chunks long (16 tokens each; or two 128-token chunks in the compiled step,
    whose ops' outputs must be laid out as their fakes say) and 64 new tokens."""
    path = tiny_model_dir(KIND)
    prompt = random_prompts([16 * CHUNK], VOCAB_SIZE, seed=31)[0]
    ref_tokens, ref_lps = hf_greedy_logprobs(hf_model(path), prompt, 64)
    max_len = 16 * CHUNK + 64
    llm = _llm(path, max_model_len=max_len, num_kv_blocks=90, max_num_batched_tokens=chunk, **mode)
    tokens, lps = _greedy(llm, [prompt], 64)
    assert tokens[0] == ref_tokens
    # NOTE: at this length transformers' own one-pass forward and its cached decode differ by
    # up to ~1e-4 (the delta rule's chunked and recurrent forms round apart): the tolerance is
    # 1e-4 or twice that spread, whichever is larger
    tol = max(LOGPROB_TOL, 2 * _reference_spread(hf_model(path), prompt, ref_tokens, ref_lps))
    err = max(abs(a - b) for a, b in zip(lps[0], ref_lps, strict=True))
    assert err < tol, f"logprob error {err:.2e} (tolerance {tol:.2e})"
    assert llm.stats()["compile"]["compiled"] is not mode["enforce_eager"]
    assert_engine_clean(llm)


@torch.no_grad()
def _reference_spread(hf, prompt: list[int], tokens: list[int], lps: list[float]) -> float:
    """How far transformers' one-pass forward over prompt + tokens is from its cached decode."""
    logprobs = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    start = len(prompt) - 1
    return max(
        abs(float(logprobs[start + j, t]) - lp)
        for j, (t, lp) in enumerate(zip(tokens, lps, strict=True))
    )


def _drop_state(monkeypatch) -> None:
    """Every state zeroed before every step: nothing carried between a request's steps."""
    prepare = runner_module.prepare_states

    def clear_all(states, moves, upload):
        rows = next(t for layer in states if layer for t in layer.values()).shape[0]
        prepare(states, StateMoves(clear=list(range(rows))), upload)

    monkeypatch.setattr(runner_module, "prepare_states", clear_all)


def _misorder(monkeypatch) -> None:
    """Decode rows read and write each other's state (the slot order reversed)."""
    build = InputBuilder._state_slots

    def reversed_slots(self, meta, staging, rows, num_decodes, slots):
        fresh = build(self, meta, staging, rows, num_decodes, slots)
        if num_decodes > 1:
            meta.decode_state_slots = meta.decode_state_slots.flip(0)
        return fresh

    monkeypatch.setattr(InputBuilder, "_state_slots", reversed_slots)


def _keep_old_state(monkeypatch) -> None:
    """A new request's slot is not cleared: it starts from a finished request's state."""
    prepare = runner_module.prepare_states

    def no_clears(states, moves, upload):
        prepare(states, replace(moves, clear=[]), upload)

    monkeypatch.setattr(runner_module, "prepare_states", no_clears)


@pytest.mark.parametrize("fault", [_drop_state, _misorder, _keep_old_state])
def test_the_family_check_fails_when_the_state_is_dropped_or_misordered(
    fault, monkeypatch, tiny_model_dir, hf_model
):
    """The comparison ``test_families`` makes (here on two rounds of the same prompts, so
    slots are reused) sees each fault: the state is what carries these models."""
    path = tiny_model_dir(KIND)
    prompts = _prompts()
    hf = hf_model(path)
    ref = [hf_greedy_logprobs(hf, p, 8)[0] for p in prompts]
    llm = _llm(path)
    assert [_greedy(llm, prompts, 8)[0] for _ in range(2)] == [ref, ref]
    fault(monkeypatch)
    faulty = [_greedy(llm, prompts, 8)[0] for _ in range(2)]
    assert faulty != [ref, ref], f"{fault.__name__} went unnoticed"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(layer_types=["linear_attention", "mamba", "full_attention"]), r"\['mamba'\]"),
        (dict(layer_types=["linear_attention", "full_attention"]), "lists 2 layers"),
        (dict(linear_num_key_heads=3), "4 value heads do not group over 3 key heads"),
    ],
)
def test_inconsistent_layer_configs_are_refused_by_name(change, expected, tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir(KIND), tmp_path)
    _edit_config(model, **change)
    with pytest.raises((UnsupportedModelError, ValueError), match=expected):
        _llm(model)


def test_serve_exits_2_on_an_unknown_layer_kind(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir(KIND), tmp_path)
    _edit_config(model, layer_types=["linear_attention", "mamba", "full_attention"])
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot serve" in done.stderr and "'mamba'" in done.stderr, done.stderr[-2000:]


def test_an_attention_free_model_sizes_its_pool_without_kv_bytes(tiny_model_dir):
    """Mamba 2 has no attention layer: no KV bytes, blocks sized from the token budget alone
    (the default CPU budget divided by zero bytes a block before)."""
    llm = LLM(str(tiny_model_dir("mamba2")), max_model_len=64, max_num_seqs=2, enforce_eager=True)
    stats = llm.stats()
    assert stats["kv_bytes_per_token"] == 0 and stats["kv_cache_bytes"] == 0
    assert stats["kv_blocks_total"] * 16 >= 2 * 64 and stats["state_bytes_per_request"] > 0
    assert len(_greedy(llm, [[5, 6, 7]], 4)[0][0]) == 4


@pytest.mark.parametrize("kind", ["qwen3_5", "kimi_linear"])
def test_a_hybrid_restores_from_its_snapshot_bitwise(kind, tiny_model_dir, tmp_path):
    """Tier A for a hybrid: a cold boot publishes (state layers' weights, the KDA's stacked
    projections and latent attention's absorbed form included), a restore boots from it and
    answers with the cold boot's tokens, logprobs within float32 rounding. (Not bit for bit:
    the mapped weights sit at other alignments than the loaded ones, and the GEMMs round by
    alignment; the tiny llama differs by 4.8e-7 the same way under these settings.)"""
    path, store = tiny_model_dir(kind), tmp_path / "store"
    prompts = random_prompts([5, 23], VOCAB_SIZE, seed=9)
    cold = _llm(path, snapshot_store=str(store))
    assert cold.engine.start_info.path == "cold"
    want = _greedy(cold, prompts, 8)
    cold.close()
    restored = _llm(path, snapshot_store=str(store))
    assert restored.engine.start_info.path == "restored_image", restored.engine.start_info
    tokens, lps = _greedy(restored, prompts, 8)
    assert tokens == want[0]
    pairs = [(a, b) for x, y in zip(lps, want[1], strict=True) for a, b in zip(x, y, strict=True)]
    assert max(abs(a - b) for a, b in pairs) < 1e-5
    assert_engine_clean(restored)
