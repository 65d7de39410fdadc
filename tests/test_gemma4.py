"""Gemma 4's KV sharing, cache layout and load-time checks: the shared layers keep no K/V
(the engine's bytes per token count the other layers only, laid out for the widest layer) and
read their source's pages; a checkpoint carrying their unused K/V tensors (as Google's do)
loads; settings it cannot serve are refused by name. Its outputs against transformers:
``test_families`` (``family_specs/gemma4.py``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from warmboot import LLM
from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import KVLayout
from warmboot.models.loader import build_model, load_model

KIND = "gemma4"  # NOTE: 6 layers, the last two reading layers 3 (sliding) and 2 (full)
SOURCES = (None, None, None, None, 3, 2)
FP32 = 4


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_shared_layers_keep_no_kv_and_read_their_sources_pages(tiny_model_dir):
    llm = LLM(str(tiny_model_dir(KIND)), max_model_len=64, block_size=4, enforce_eager=True)
    runner = llm.engine.runner
    # NOTE: 2 K/V heads of 12 (sliding) and 1 of 20 (full): the cache keeps 2 heads of 20
    assert runner.kv_layout == KVLayout(2, 2, 20, kv_sources=SOURCES)
    assert llm.stats()["kv_bytes_per_token"] == 4 * 2 * 2 * 20 * FP32  # NOTE: 4 of 6 layers
    for layer, source in ((4, 3), (5, 2)):
        assert runner.kv_caches[layer][0] is runner.kv_caches[source][0]
        assert runner.kv_caches[layer][1] is runner.kv_caches[source][1]
    owned = {runner.kv_caches[i][0].data_ptr() for i in range(4)}
    assert len(owned) == 4


def test_a_shared_layers_unused_kv_tensors_load(tiny_model_dir, tmp_path):
    path = tmp_path / "with-shared-kv-tensors"
    shutil.copytree(tiny_model_dir(KIND), path)
    weights = load_file(path / "model.safetensors")
    for i, dim in ((4, 12), (5, 20)):
        prefix = f"model.layers.{i}.self_attn"
        weights[f"{prefix}.k_proj.weight"] = torch.ones(dim, 48)
        weights[f"{prefix}.k_norm.weight"] = torch.ones(dim)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    assert model.kv_layout().kv_sources == SOURCES
    assert not hasattr(model.layers[4].self_attn, "k_norm")


def test_an_older_config_derives_the_full_layers_shape(tiny_model_dir):
    """Without ``per_layer_config``: ``global_head_dim`` on the full layers, and their K/V
    heads from ``num_global_key_value_heads`` only with ``attention_k_eq_v``."""
    hf = _config(tiny_model_dir(KIND))
    del hf["per_layer_config"]
    older = hf | dict(global_head_dim=20, num_global_key_value_heads=1)
    assert build_model(ModelConfig.from_dict(older)).kv_layout().dim == 20
    shapes = build_model(ModelConfig.from_dict(older | {"attention_k_eq_v": False})).shapes
    assert [(s.kv_heads, s.head_dim) for s in shapes[1:3]] == [(2, 12), (2, 20)]
    assert build_model(ModelConfig.from_dict(hf)).shapes[2].head_dim == 512  # its default


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
        (dict(num_kv_shared_layers=6), "num_kv_shared_layers 6"),
        (dict(num_kv_shared_layers=4), "num_kv_shared_layers 4"),  # NOTE: no full layer kept
        (dict(vocab_size_per_layer_input=400), "vocab_size_per_layer_input 400"),
        (dict(per_layer_config={"2": {"intermediate_size": 64}}), "intermediate_size"),
        (dict(per_layer_config={"0": {"head_dim": 16}}), "layers of one type differ"),
        (dict(per_layer_config={str(i): {"num_key_value_heads": 3} for i in (2, 5)}), "3 K/V"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}}),
            "rope_theta for 'sliding_attention'",
        ),
        (
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_theta": 1e4},
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                }
            ),
            "rope_type 'yarn'",
        ),
        (dict(enable_moe_block=True, num_experts=4), "enable_moe_block"),
        (dict(layer_types=["chunked_attention"] * 6), "chunked_attention"),
        (dict(hidden_activation="snake"), "snake"),
    ],
)
def test_unserved_settings_are_refused_by_name(change, expected, tiny_model_dir):
    cfg = ModelConfig.from_dict(_config(tiny_model_dir(KIND)) | change)
    with pytest.raises(UnsupportedModelError, match=expected):
        build_model(cfg)
