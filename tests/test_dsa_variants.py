"""What A.X-K2, HY-V4 and dots3-note add to sparse indexed attention beyond the family runs
(``test_families``): A.X-K2's group masking to 0.0, attention sinks in the indexed attention
against a float64 reference, dots3-note's released config keys read as transformers derives
them, and bad settings refused at load by name."""

from __future__ import annotations

import json

import pytest
import torch

from warmboot import LLM
from warmboot.architectures import UnsupportedModelError
from warmboot.kernels.sparse_attention import attend
from warmboot.models.axk2 import ZeroMaskedRouter
from warmboot.models.dots3_note import dots_settings


def test_axk2_groups_masked_to_zero():
    """Kept group (0, 1) holds a negative choice score; the masked group's experts score 0.0
    and win the last two picks (a -inf mask would pick expert 1)."""
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    cfg = AXK2Config(
        hidden_size=8, n_routed_experts=4, num_experts_per_tok=3, n_group=2, topk_group=1
    )
    bias = torch.tensor([0.9, -0.7, -0.2, -0.2])
    ref = AXK2TopkRouter(cfg)
    ref.weight.data.zero_()
    ref.e_score_correction_bias.copy_(bias)
    ours = ZeroMaskedRouter(
        8,
        4,
        3,
        scoring="sigmoid",
        renormalize=True,
        scale=2.5,
        correction_bias=True,
        groups=2,
        topk_groups=1,
        float32=True,
    )
    ours.weight.data.zero_()
    ours.e_score_correction_bias.data.copy_(bias)
    x = torch.randn(5, 8)
    _, ref_w, ref_ids = ref(x)
    weights, ids = ours(x)
    assert sorted(ids[0].tolist()) == sorted(ref_ids[0].tolist()) == [0, 2, 3]
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order))


def test_sinks_in_indexed_attention_match_float64():
    gen = torch.Generator().manual_seed(7)
    b, r, hq, hkv, d, length = 2, 3, 4, 2, 8, 11
    q = torch.randn(b, r, hq, d, generator=gen)
    k, v = (
        torch.randn(b, length, hkv, d, generator=gen),
        torch.randn(b, length, hkv, d, generator=gen),
    )
    mask = torch.rand(b, 1, r, length, generator=gen) < 0.6
    mask[..., 0] = True
    sinks = torch.randn(hq, generator=gen)
    got = attend(q, k, v, mask, 0.3, sinks)
    kk, vv = (t.double().repeat_interleave(hq // hkv, dim=2) for t in (k, v))
    scores = torch.einsum("brhd,blhd->bhrl", q.double(), kk) * 0.3
    scores = scores.masked_fill(~mask, float("-inf"))
    full = torch.cat([scores, sinks.double().view(1, hq, 1, 1).expand(b, hq, r, 1)], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :-1]
    want = torch.einsum("bhrl,blhd->brhd", probs, vv)
    assert torch.allclose(got.double(), want, atol=1e-6)
    plain = attend(q, k, v, mask, 0.3)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_dots3_released_keys_read_as_transformers_does():
    from transformers import Dots3NoteTextConfig

    released = dict(
        num_hidden_layers=7,
        first_k_dense_replace=2,
        moe_layer_freq=[0, 0, 1, 0, 1, 1, 1],
        use_dsa=True,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=2,
        swa_q_lora_rank=24,
        swa_kv_lora_rank=40,
        swa_head_dim=32,
        swa_qk_nope_head_dim=20,
        swa_rope_theta=500.0,
        sliding_window_size=16,
        moe_shared_expert_intermediate_size=20,
        rope_theta=1000.0,
    )
    ref = Dots3NoteTextConfig(**released)
    ours = dots_settings(dict(released), 7)
    assert ours["layer_types"] == ref.layer_types
    assert ours["mlp_layer_types"] == ref.mlp_layer_types
    assert ours["sliding_window"] == ref.sliding_window == 16
    assert ours["shared_experts_intermediate_size"] == ref.shared_experts_intermediate_size
    for i in range(7):
        layer = ref.per_layer_config[i]
        for name, value in ours["per_layer_config"].get(str(i), {}).items():
            assert getattr(layer, name) == value, (i, name)
    for kind, params in ref.rope_parameters.items():
        assert ours["rope_parameters"][kind]["rope_theta"] == params["rope_theta"]


BAD = [
    ("axk2", dict(n_group=2, topk_group=None), "n_group 2 with topk_group None"),
    ("axk2", dict(gated_norm_rank=0), "gated_norm_rank"),
    ("hy_v4", dict(swiglu_limit=0.0), "swiglu_limit"),
    ("hy_v4", dict(hc_mult=0), "hc_mult"),
    ("hy_v4", dict(indexer_types=["shared", "full", "full", "shared"]), "first layer shares"),
    ("dots3_note_text", dict(per_layer_config={"1": {"intermediate_size": 8}}), "per_layer_config"),
    ("dots3_note_text", dict(per_layer_config={"1": {"q_lora_rank": 8}}), "differing among"),
    ("dots3_note_text", dict(layer_types=["indexed_attention", "chunked"] * 2), "layer_types"),
    ("dots3_note_text", dict(sliding_window=0), "sliding_window"),
    (
        "dots3_note_text",
        dict(rope_parameters={"indexed_attention": {}, "sliding_attention": {"rope_type": "yarn"}}),
        "rope_type 'yarn'",
    ),
]


@pytest.mark.parametrize(("kind", "change", "named"), BAD, ids=[f"{k}-{n}" for k, _, n in BAD])
def test_bad_settings_are_refused(tiny_model_dir, tmp_path, kind, change, named):
    source = tiny_model_dir(kind)
    for f in source.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((source / "config.json").read_text()) | change
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=named):
        LLM(str(tmp_path), max_model_len=64, enforce_eager=True)
