"""Ling's hybrid (``bailing_hybrid``) beyond ``test_families``: a config.json as Ling ships it
(no layer lists, Ling's MoE names, the linear head dim under ``head_dim``) read as transformers
reads it, the official checkpoint names, and the settings refused by name."""

from __future__ import annotations

import pytest

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.loader import build_model

_RAW = dict(
    architectures=["BailingHybridForCausalLM"],
    model_type="bailing_hybrid",
    vocab_size=64,
    hidden_size=48,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=10,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    num_expert_group=4,
    topk_group=2,
    moe_intermediate_size=24,
    intermediate_size=40,
    layer_group_size=3,
    short_conv_kernel_size=3,
    pad_token_id=0,
    eos_token_id=0,
)


def _model(**change):
    return build_model(ModelConfig.from_dict({**_RAW, **change}))


def test_a_ling_config_reads_as_transformers_reads_it():
    from transformers import BailingHybridConfig

    ref = BailingHybridConfig(**{k: v for k, v in _RAW.items() if k != "architectures"})
    cfg = _model().cfg
    assert cfg.get("layer_types") == ref.layer_types
    assert cfg.get("mlp_layer_types") == ref.mlp_layer_types
    ours = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "n_group")
    assert [cfg.get(k) for k in ours] == [getattr(ref, k) for k in ours]
    assert cfg.get("n_routed_experts") == ref.num_local_experts == 8
    assert cfg.get("num_experts_per_tok") == ref.num_experts_per_tok == 2
    assert cfg.get("routed_scaling_factor") == ref.routed_scaling_factor
    assert cfg.get("kda_lower_bound") == ref.kda_lower_bound


def test_the_official_checkpoint_names_are_read():
    model = _model()  # layers 2 and 5 attend; 0 and 1 dense
    names = {
        "model.word_embeddings.weight": ("embed_tokens.weight", None),
        "model.layers.0.attention.k_proj.weight": ("layers.0.self_attn.in_proj.weight", 1),
        "model.layers.0.attention.f_proj.weight": ("layers.0.self_attn.in_proj.weight", 3),
        "model.layers.0.attention.g_proj.weight": ("layers.0.self_attn.in_proj.weight", 4),
        "model.layers.0.attention.v_conv1d.weight": ("layers.0.self_attn.conv1d.weight", 2),
        "model.layers.0.attention.A_log": ("layers.0.self_attn.A_log", None),
        "model.layers.0.attention.dense.weight": ("layers.0.self_attn.o_proj.weight", None),
        "model.layers.2.attention.g_proj.weight": ("layers.2.self_attn.g_proj.weight", None),
        "model.layers.2.attention.dense.weight": ("layers.2.self_attn.o_proj.weight", None),
        "model.layers.3.mlp.gate.expert_bias": ("layers.3.mlp.gate.e_score_correction_bias", None),
        "model.layers.3.mlp.experts.5.up_proj.weight": ("layers.3.mlp.experts.gate_up_proj", 11),
        "model.layers.3.mlp.shared_experts.down_proj.weight": (
            "layers.3.mlp.shared_expert.down_proj.weight",
            None,
        ),
        "model.layers.7.eh_proj.weight": None,  # NOTE: the multi-token-prediction layer
    }
    params = dict(model.named_parameters())
    for name, expected in names.items():
        assert model.map_name(name) == expected, name
        assert expected is None or expected[0] in params, expected


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(num_key_value_heads=2), "num_key_value_heads 2 != 4 heads"),
        (dict(num_key_value_heads=None, num_attention_heads=4), None),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(num_local_experts=6), "settings that disagree"),
        (dict(layer_types=["linear_attention"] * 6 + ["mamba"]), r"\['mamba'\]"),
        (dict(num_expert_group=3), "n_group 3 / topk_group 2 for 8 experts"),
    ],
)
def test_settings_it_does_not_serve_are_refused_by_name(change, expected):
    if expected is None:
        _model(**change)  # NOTE: null KV heads are the heads (transformers' reading)
        return
    with pytest.raises(UnsupportedModelError, match=expected):
        _model(**change)
