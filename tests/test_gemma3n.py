"""Gemma 3n's KV sharing and load-time checks: the shared layers keep no K/V (the cache's
bytes per token count the other layers only), a checkpoint carrying their unused K/V
tensors (as Google's do) loads, and settings it cannot serve are refused by name. Its
outputs against transformers: ``test_families`` (``family_specs/gemma3n.py``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.loader import build_model, load_model

KIND = "gemma3n_shared_kv"  # NOTE: 6 layers, the last two reading layers 1 and 3


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_shared_layers_keep_no_kv_and_their_unused_tensors_load(tiny_model_dir, tmp_path):
    path = tmp_path / "with-shared-kv-tensors"
    shutil.copytree(tiny_model_dir(KIND), path)
    weights = load_file(path / "model.safetensors")
    for i in (4, 5):
        prefix = f"model.layers.{i}.self_attn"
        weights[f"{prefix}.k_proj.weight"] = torch.ones(32, 48)
        weights[f"{prefix}.v_proj.weight"] = torch.ones(32, 48)
        weights[f"{prefix}.k_norm.weight"] = torch.ones(16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64)
    layout = model.kv_layout()
    assert layout.kv_sources == (None, None, None, None, 1, 3)
    assert layout.num_attention_layers(cfg.num_layers) == 4
    attn = model.layers[4].self_attn
    assert attn.qkv_proj.out_features == cfg.num_heads * cfg.head_dim
    assert not hasattr(attn, "k_norm")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(altup_active_idx=3), "altup_active_idx 3"),
        (dict(num_kv_shared_layers=6), "num_kv_shared_layers 6"),
        (dict(num_kv_shared_layers=5), "no earlier full_attention layer"),
        (dict(intermediate_size=[64] * 5), "intermediate_size lists 5"),
        (dict(activation_sparsity_pattern=[0.5] * 7), "activation_sparsity_pattern lists 7"),
        (dict(layer_types=["chunked_attention"] * 6), "chunked_attention"),
        (dict(hidden_activation="snake"), "snake"),
    ],
)
def test_unserved_settings_are_refused_by_name(change, expected, tiny_model_dir):
    cfg = ModelConfig.from_dict(_config(tiny_model_dir(KIND)) | change)
    with pytest.raises(UnsupportedModelError, match=expected):
        build_model(cfg)
