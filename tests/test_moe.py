"""The mixture-of-experts layer: every router against transformers' own router modules, the
grouped expert step (dense and oneDNN-packed) against a per-token loop, and a MoE model's
snapshot: restored bitwise, its compile artifacts carried, its expert chunks shared with a
second snapshot of the same weights. The families themselves: ``test_families``."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe

from tests.helpers import random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.kernels.step_ops import ExpertTable, can_pack
from warmboot.models.layers.moe import FusedExperts, Router, clamped_swiglu
from warmboot.snapshot.image import Manifest
from warmboot.snapshot.store import LocalStore

HIDDEN, EXPERTS = 24, 8


def _hf(module_cls, config_cls, **kw):
    config = getattr(transformers, config_cls)(hidden_size=HIDDEN, num_attention_heads=4, **kw)
    return module_cls(config)


ROUTERS = {
    "softmax-topk-renormalised (Mixtral)": (
        lambda: _hf(
            mixtral.MixtralTopKRouter, "MixtralConfig", num_local_experts=8, num_experts_per_tok=2
        ),
        dict(top_k=2, renormalize=True),
    ),
    "softmax-topk (Qwen2-MoE, norm_topk_prob false)": (
        lambda: _hf(
            qwen2_moe.Qwen2MoeTopKRouter,
            "Qwen2MoeConfig",
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
        dict(top_k=3),
    ),
    "topk-softmax with bias (GPT-OSS)": (
        lambda: _hf(
            gpt_oss.GptOssTopKRouter, "GptOssConfig", num_local_experts=8, num_experts_per_tok=2
        ),
        dict(top_k=2, softmax_after_topk=True, bias=True),
    ),
    "group-limited greedy, scaled (DeepSeek-V2)": (
        lambda: _hf(
            ds2.DeepseekV2TopkRouter,
            "DeepseekV2Config",
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.7,
        ),
        dict(top_k=3, groups=4, topk_groups=2, group_score="max", scale=1.7, float32=True),
    ),
    "sigmoid, correction bias, top-2 groups, normalised (DeepSeek-V3)": (
        lambda: _hf(
            ds3.DeepseekV3TopkRouter,
            "DeepseekV3Config",
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        dict(
            top_k=2,
            scoring="sigmoid",
            correction_bias=True,
            groups=4,
            topk_groups=2,
            renormalize=True,
            scale=2.5,
            float32=True,
        ),
    ),
}


@pytest.mark.parametrize("name", ROUTERS)
def test_router_matches_transformers(name):
    make_hf, options = ROUTERS[name]
    torch.manual_seed(0)
    hf = make_hf()
    ours = Router(HIDDEN, EXPERTS, **options)
    with torch.no_grad():
        for tensor_name, p in hf.named_parameters(recurse=False):
            p.normal_()
            getattr(ours, tensor_name).data = p.detach().clone()
        for tensor_name, b in hf.named_buffers(recurse=False):
            b.normal_(std=0.3)
            getattr(ours, tensor_name).data = b.detach().clone()
        x = torch.randn(64, HIDDEN)
        _, ref_weights, ref_ids = hf(x)
        weights, ids = ours(x)
    ref = torch.zeros(64, EXPERTS).scatter_(1, ref_ids, ref_weights.float())
    got = torch.zeros(64, EXPERTS).scatter_(1, ids, weights.float())
    assert torch.equal(ref != 0, got != 0), f"{name}: other experts chosen"
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _experts(bias: bool, act_and_mul=None) -> FusedExperts:
    torch.manual_seed(1)
    m = FusedExperts(EXPERTS, HIDDEN, 20, bias=bias, act_and_mul=act_and_mul)
    for p in m.parameters():
        p.data.normal_(std=0.2)
    return m


def _per_token(m: FusedExperts, x, weights, ids) -> torch.Tensor:
    """The definition: each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist(), strict=True):
            h = x[t] @ m.gate_up_proj[e].T
            if m.gate_up_proj_bias is not None:
                h = h + m.gate_up_proj_bias[e]
            y = m.act_and_mul(h) @ m.down_proj[e].T
            if m.down_proj_bias is not None:
                y = y + m.down_proj_bias[e]
            out[t] += w * y
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias+clamped-swiglu"])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_grouped_experts_equal_a_per_token_loop(bias, rows):
    m = _experts(bias, clamped_swiglu(limit=0.5) if bias else None)
    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(rows)])
    ids[ids == 5] = 6  # NOTE: expert 5 gets no token, 6 gets more
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % 5, ids[:, 1])
    weights = torch.rand(rows, 2)
    with torch.no_grad():
        ref = _per_token(m, x, weights, ids)
        torch.testing.assert_close(m(x, weights, ids), ref, rtol=1e-5, atol=1e-5)
        if can_pack(torch.float32, torch.device("cpu")):
            packed = ExpertTable(m, pack=True)
            torch.testing.assert_close(packed(x, weights, ids), ref, rtol=1e-5, atol=1e-5)
            assert packed.release() > 0 and packed.gate_up is None
            with pytest.raises(RuntimeError, match="released"):
                packed(x, weights, ids)
            packed.repack()
            torch.testing.assert_close(packed(x, weights, ids), ref, rtol=1e-5, atol=1e-5)


PROMPTS = random_prompts([7, 30, 12], VOCAB_SIZE, seed=3)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _outputs(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_moe_snapshot_restores_bitwise_and_shares_its_expert_chunks(tiny_model_dir, tmp_path):
    path, store = tiny_model_dir("qwen2_moe"), tmp_path / "store"
    args = dict(max_model_len=96, block_size=4, num_kv_blocks=48, enforce_eager=False)
    args["snapshot_store"] = str(store)
    cold = LLM(str(path), **args)
    assert cold.engine.start_info.path == "cold"
    golden = _outputs(cold)
    del cold
    warm = LLM(str(path), **args)
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info
    warm.engine.startup.wait_compiled()
    compile_info = warm.stats()["compile"]
    assert compile_info["compiled"] and compile_info["cache_misses"] == 0, compile_info
    assert _outputs(warm) == golden
    del warm
    # another snapshot of the same weights (another max_model_len: another key) stores them
    # once: the expert tensors are the same chunks in both manifests
    other = LLM(str(path), **(args | dict(max_model_len=80)))
    assert other.engine.start_info.path == "cold" and _outputs(other) == golden
    local = LocalStore(store)
    manifests = [Manifest.from_json(local.get_manifest(k)) for k in local.list_keys()]
    assert len(manifests) == 2
    experts = [
        {t.name: [c.hash for c in t.chunks] for t in m.tensors if ".experts." in t.name}
        for m in manifests
    ]
    assert experts[0] and experts[0] == experts[1]


@pytest.mark.parametrize(
    ("config_cls", "settings"),
    [
        ("Qwen3MoeConfig", dict(decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4)),
        ("Qwen2MoeConfig", dict(decoder_sparse_step=3, num_experts=4)),
        ("DeepseekV3Config", dict(first_k_dense_replace=2, n_routed_experts=4, n_group=2)),
    ],
)
def test_sparse_and_dense_layers_as_transformers_places_them(config_cls, settings):
    """Which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``,
    ``first_k_dense_replace``): ours against transformers' own modules, both on meta."""
    import json

    from warmboot.config import ModelConfig
    from warmboot.models.layers.moe import SparseMoE
    from warmboot.models.loader import build_model

    config = getattr(transformers, config_cls)(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=6,
        num_experts_per_tok=2,
        topk_group=1,
        **settings,
    )
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    expected = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    hf_dict = json.loads(config.to_json_string()) | {"architectures": [type(hf).__name__]}
    ours = build_model(ModelConfig.from_dict(hf_dict))
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == expected
    assert any(expected) and not all(expected)
