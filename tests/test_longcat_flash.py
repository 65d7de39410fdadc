"""LongCat-Flash's pieces beside its end-to-end test (``test_families``): the shortcut MoE
with zero experts against transformers' own ``LongcatFlashMoE`` (one row and many, rows
whose picks are all zero experts, dense and oneDNN-packed experts), and the settings it does
not serve refused by name when the model is built."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.step_ops import ExpertTable, can_pack
from warmboot.models.longcat_flash import LongcatFlashForCausalLM

ROUTED, ZERO, TOP_K, HIDDEN = 4, 3, 3, 24


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' MoE block with random weights, and ours (a tiny model's) holding them."""
    # NOTE: imported here: its modeling module imports triton, which the Triton tests import
    # first, after setting TRITON_INTERPRET (collection imports every test module)
    from transformers.models.longcat_flash import modeling_longcat_flash as hf_longcat

    config = transformers.LongcatFlashConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        num_layers=1,
        num_attention_heads=2,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=8,
        ffn_hidden_size=16,
        n_routed_experts=ROUTED,
        zero_expert_num=ZERO,
        moe_topk=TOP_K,
        expert_ffn_hidden_size=10,
        routed_scaling_factor=1.7,
    )
    torch.manual_seed(0)
    hf = hf_longcat.LongcatFlashMoE(config).eval()
    cfg = config.to_dict() | {"architectures": ["LongcatFlashForCausalLM"]}
    ours = LongcatFlashForCausalLM(ModelConfig.from_dict(cfg)).layers[0].moe
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.router.e_score_correction_bias.normal_(0, 0.1)
        ours.gate.weight.copy_(hf.router.classifier.weight)
        ours.gate.e_score_correction_bias.copy_(hf.router.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj[:ROUTED])
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return hf, ours


@pytest.mark.parametrize("rows", [1, 2, 40])
def test_zero_experts_match_transformers(rows):
    hf, ours = _pair()
    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN)
    with torch.no_grad():
        _, _, hf_ids = hf.router(x)
        assert (hf_ids >= ROUTED).any(), "the test rows pick no zero expert"
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
        if can_pack(torch.float32, torch.device("cpu")):  # NOTE: the compiled step's experts
            weights, ids = ours.gate(x)
            packed = ExpertTable(ours.experts, pack=True)
            dense = ours.experts(x, weights, ids)
            torch.testing.assert_close(packed(x, weights, ids), dense, rtol=1e-5, atol=1e-5)


def test_a_row_of_zero_experts_only_is_the_row_scaled():
    hf, ours = _pair()
    with torch.no_grad():
        ours.gate.e_score_correction_bias[:ROUTED] = -10.0  # NOTE: only the zero experts win
        hf.router.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
        x = torch.randn(5, HIDDEN)
        for rows in (x, x[:1]):
            assert bool((hf.router(rows)[2] >= ROUTED).all())
            torch.testing.assert_close(ours(rows), hf(rows), rtol=1e-5, atol=1e-5)


REFUSED = {
    "head_dim": (dict(head_dim=24), "head_dim 24"),
    "kv_heads": (dict(num_key_value_heads=2), "num_key_value_heads"),
    "qk_head_dim": (dict(qk_head_dim=40), "qk_head_dim 40"),
    "q_lora_rank": (dict(q_lora_rank=None), "q_lora_rank null"),
    "moe_topk": (dict(moe_topk=9), "moe_topk 9"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unserved_settings_are_refused_by_name(case, tiny_model_dir):
    change, words = REFUSED[case]
    cfg = json.loads((tiny_model_dir("longcat_flash") / "config.json").read_text()) | change
    with pytest.raises(UnsupportedModelError, match=words):
        LongcatFlashForCausalLM(ModelConfig.from_dict(cfg))


def test_the_engine_counts_the_sublayers_as_layers(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir("longcat_flash"))
    assert cfg.num_layers == 4  # NOTE: num_layers 2, two attention sublayers each
