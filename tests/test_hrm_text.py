"""HRM-Text's pieces beside its end-to-end test (``test_families``): the calls of one stack's
layer share its weights once loaded, in the snapshot's parameters and in the compiled step's
packed weights (through release, stash and repack); transformers' own parameter names load
as its saved ones do; the call count from old and new configs; settings refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.step_ops import HEAD_SLOT
from warmboot.models.layers.linear import Linear
from warmboot.models.loader import build_model

ARGS = dict(max_model_len=64, block_size=4, num_kv_blocks=64)
CALLS, STACK_LAYERS = 12, 4
"""The tiny spec's engine layers (2 H cycles of 2 L calls and an H call, 2 layers a stack)
and its distinct layers (2 a stack)."""


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 3], VOCAB_SIZE, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _distinct(tensors) -> int:
    return len({id(t) for t in tensors})


def test_calls_share_their_stack_layer_weights(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("hrm_text")), enforce_eager=True, **ARGS)
    model = llm.engine.runner.model
    assert len(model.layers) == CALLS
    names = {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert names == {"0", "1", "4", "5"}, "only each stack's first call is named (snapshots)"
    gqkv = [layer.self_attn.gqkv_proj.weight for layer in model.layers]
    assert _distinct(gqkv) == STACK_LAYERS
    assert gqkv[2] is gqkv[0] and gqkv[10] is gqkv[4] and gqkv[4] is not gqkv[0]


def test_packed_weights_once_a_shared_weight_through_release_and_repack(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("hrm_text")), enforce_eager=False, **ARGS)
    before = _greedy(llm)
    table = llm.engine.runner.compiled.linears

    def packed():
        return [w for row in table.layers for w, _ in row]

    assert len(packed()) == CALLS * 4 and _distinct(packed()) == STACK_LAYERS * 4
    weights = [*_linear_weights(llm.engine.runner.model), table.source(0, HEAD_SLOT)]
    assert table.release() == sum(w.numel() * w.element_size() for w in weights)
    table.repack()
    assert _distinct(packed()) == STACK_LAYERS * 4
    assert _greedy(llm) == before


def _linear_weights(model) -> list[torch.Tensor]:
    linears = (m for m in model.layers.modules() if isinstance(m, Linear))
    return list({id(m.weight): m.weight for m in linears}.values())


def test_stashed_shared_packing_is_kept_once(tiny_model_dir, tmp_path, monkeypatch):
    from warmboot.kernels.step_ops import native_gemm
    from warmboot.snapshot import stash
    from warmboot.snapshot.store import LocalStore

    llm = LLM(str(tiny_model_dir("hrm_text")), enforce_eager=False, dtype="bfloat16", **ARGS)
    table = llm.engine.runner.compiled.linears
    if not native_gemm(table.source(0, 0)):
        pytest.skip("no native bf16 GEMM here: its panels are what a stash keeps")
    before = _greedy(llm)
    calls = []
    keep, _ = stash.keeper(LocalStore(tmp_path / "store"))
    monkeypatch.setattr(stash, "stash", _counting(stash.stash, calls))
    table.stash(keep)
    assert len(calls) == STACK_LAYERS * 4 + 1, "each shared packing stashed once, and the head"
    assert _distinct(w for row in table.layers for w, _ in row) == STACK_LAYERS * 4
    table.repack()
    assert _greedy(llm) == before


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_transformers_parameter_names_load_as_its_saved_ones(tiny_model_dir, hf_model, tmp_path):
    """transformers saves gate/q/k/v and gate/up weights fused (``attn.gqkv_proj``); a
    checkpoint under its in-memory names (each projection apart) serves the same."""
    path = tiny_model_dir("hrm_text")
    state = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert "model.L_module.layers.0.self_attn.gate_proj.weight" in state
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    save_file(state, tmp_path / "model.safetensors")
    saved = LLM(str(path), enforce_eager=True, **ARGS)
    assert _greedy(LLM(str(tmp_path), enforce_eager=True, **ARGS)) == _greedy(saved)


def _config(tiny_model_dir, **changes) -> ModelConfig:
    cfg = json.loads((tiny_model_dir("hrm_text") / "config.json").read_text())
    return ModelConfig.from_dict({k: v for k, v in (cfg | changes).items() if v is not None})


def test_call_count_from_saved_and_older_configs(tiny_model_dir):
    assert _config(tiny_model_dir).num_layers == CALLS
    older = _config(tiny_model_dir, num_layers_per_stack=None, num_hidden_layers=3)
    assert older.num_layers == 3 * 2 * 3
    defaults = _config(tiny_model_dir, H_cycles=None, L_cycles=None)
    assert defaults.num_layers == 2 * 2 * 4  # NOTE: transformers' 2 H cycles of 3 L calls


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(L_cycles=0), "L_cycles 0"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial"),
    ],
)
def test_settings_it_cannot_serve_are_refused_by_name(tiny_model_dir, changes, named):
    with pytest.raises(UnsupportedModelError, match=named):
        build_model(_config(tiny_model_dir, **changes))
