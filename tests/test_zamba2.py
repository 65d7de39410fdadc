"""Zamba 2's shared blocks: held once and called by several layers, each invocation with its
own K/V and adapters; settings it does not serve refused by name. Its outputs against
transformers: ``test_families`` (``family_specs/zamba2.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import ATTENTION
from warmboot.models.loader import build_model, load_model


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_a_shared_block_is_loaded_once_and_each_invocation_attends_apart(tiny_model_dir):
    path = tiny_model_dir("zamba2")  # NOTE: hybrid layers 1, 3, 4 over two blocks
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64)
    layers = model.layers
    assert layers[1].shared is layers[4].shared is model.blocks[0]
    assert layers[3].shared is model.blocks[1] and len(model.blocks) == 2
    names = [n for n, _ in model.named_parameters() if ".qkv_proj." in n]
    assert names == ["blocks.0.self_attn.qkv_proj.weight", "blocks.1.self_attn.qkv_proj.weight"]
    assert not torch.equal(layers[1].qkv_adapter.up_q.weight, layers[4].qkv_adapter.up_q.weight)
    layout = model.kv_layout()
    assert layout.kinds == ("mamba2", ATTENTION, "mamba2", ATTENTION, ATTENTION, "mamba2")
    assert all(layout.states) and layout.dim == 2 * cfg.hidden_size // cfg.num_heads


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(num_key_value_heads=2), "use_shared_attention_adapter"),
        (dict(layers_block_type=["mamba", "hybrid", "full_attention"] + ["mamba"] * 3), "full_att"),
    ],
)
def test_unserved_settings_are_refused_by_name(change, expected, tiny_model_dir):
    cfg = ModelConfig.from_dict(_config(tiny_model_dir("zamba2")) | change)
    with pytest.raises(UnsupportedModelError, match=expected):
        build_model(cfg)
