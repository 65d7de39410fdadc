"""Llama 4 text's pieces beside the family test (``test_families``): the routing against
transformers' (the top-k by logit, where a choice by sigmoid would tie), and the settings
refused at load by name."""

from __future__ import annotations

import json

import pytest
import torch

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.llama4 import Llama4ForCausalLM, Llama4Router


def test_router_picks_by_logit_where_the_sigmoids_tie():
    """Logits 20 and 30 both have sigmoid 1.0 in float32: a choice by sigmoid would take the
    first expert, transformers' (and ours) takes the larger logit, weight sigmoid(30)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router as HfRouter

    cfg = Llama4TextConfig(hidden_size=4, num_local_experts=3, num_experts_per_tok=1)
    hf, ours = HfRouter(cfg), Llama4Router(4, 3, 1)
    weight = torch.tensor([[20.0, 0, 0, 0], [30.0, 0, 0, 0], [-5.0, 0, 0, 0]])
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
    x = torch.tensor([[1.0, 0, 0, 0]])
    scores, _ = hf(x)
    weights, ids = ours(x)
    assert ids.tolist() == [[1]] and scores.argmax(-1).tolist() == [1]
    assert torch.equal(weights, scores[:, 1:2])
    assert torch.sigmoid(torch.tensor([20.0, 30.0])).unique().numel() == 1


REFUSED = {
    "layer_types": (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    "chunk": (dict(attention_chunk_size=None), "attention_chunk_size None"),
    "chunk_zero": (dict(attention_chunk_size=0), "attention_chunk_size 0"),
    "no_rope": (dict(no_rope_layers=[1, 0]), "no_rope_layers lists 2 layers"),
    "floor_scale": (dict(floor_scale=0), "floor_scale 0"),
    "top_k": (dict(num_experts_per_tok=5), "num_experts_per_tok 5 of 4"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unserved_settings_are_refused_by_name(case, tiny_model_dir):
    change, words = REFUSED[case]
    cfg = json.loads((tiny_model_dir("llama4_text") / "config.json").read_text()) | change
    with pytest.raises(UnsupportedModelError, match=words):
        Llama4ForCausalLM(ModelConfig.from_dict(cfg))


def test_defaults_follow_transformers(tiny_model_dir):
    """Without ``no_rope_layers``, ``layer_types`` and ``moe_layers``: every 4th layer NoPE
    and full, the others chunked, every ``interleave_moe_layer_step``-th layer MoE."""
    cfg = json.loads((tiny_model_dir("llama4_text") / "config.json").read_text())
    for name in ("no_rope_layers", "layer_types", "moe_layers"):
        del cfg[name]
    model = Llama4ForCausalLM(ModelConfig.from_dict(cfg))
    chunks = [a.spec.chunk for a in model.attention_layers()]
    assert chunks == [8, 8, 8, None]
    assert model.plan["rope"] == [True, True, True, False]
    assert model.plan["moe"] == {1, 3}
