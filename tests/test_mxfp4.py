"""GPT-OSS's MXFP4 experts (``tests.mxfp4_checkpoints``): held as the checkpoint's nibbles in
memory and in a snapshot (scales as exact bf16 powers of two), restored to the same tokens,
and malformed blocks or scales refused by name. Tokens and logits against transformers: the
``mxfp4-gpt-oss`` case of ``tests/test_quantized.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import random_prompts
from tests.mxfp4_checkpoints import write_gpt_oss_mxfp4
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.kernels import quant
from warmboot.models.layers.quant_linear import QuantExperts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    return write_gpt_oss_mxfp4(tmp_path_factory.mktemp("mxfp4") / "gpt-oss", seed=2)


def test_experts_stay_mxfp4_in_memory_and_in_a_snapshot(mxfp4_dir, tmp_path):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 23], VOCAB_SIZE, seed=6)]
    store = tmp_path / "store"
    cold = LLM(str(mxfp4_dir), max_model_len=96, snapshot_store=str(store), enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]
    experts = [
        m
        for m in cold.engine.runner.model.modules()
        if isinstance(getattr(m, "method", None), QuantExperts)
    ]
    assert len(experts) == 2 and all(m.method.linear.code_bits == quant.FP4 for m in experts)
    file = load_file(mxfp4_dir / "model.safetensors")
    blocks = sum(t.numel() for n, t in file.items() if n.endswith("_blocks"))
    held = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    assert held == blocks and experts[0].gate_up_proj.dtype == torch.uint8
    scales = torch.cat([unpacked_scales(m) for m in experts])
    assert scales.dtype == torch.bfloat16 and bool((torch.frexp(scales.float())[0] == 0.5).all())
    del cold
    warm = LLM(str(mxfp4_dir), max_model_len=96, snapshot_store=str(store), enforce_eager=True)
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info.reason
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == expected
    (manifest,) = (store / "manifests").glob("*.json")
    dtypes = {t["name"]: t["dtype"] for t in json.loads(manifest.read_text())["tensors"]}
    assert dtypes["layers.0.mlp.experts.gate_up_proj"] == "uint8"
    assert dtypes["layers.1.mlp.experts.down_proj_scale"] == "bfloat16"


def unpacked_scales(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([quant.unpack_groups(s) for s in (*m.gate_up_proj_scale, *m.down_proj_scale)])


def test_a_gate_up_row_is_split_from_its_interleaved_place(mxfp4_dir):
    """Row ``2j`` of the checkpoint's gate_up is gate row ``j``, row ``2j + 1`` up row ``j``."""
    llm = LLM(str(mxfp4_dir), max_model_len=64, enforce_eager=True)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    file = load_file(mxfp4_dir / "model.safetensors")
    blocks = file["model.layers.0.mlp.experts.gate_up_proj_blocks"][3]  # (2I, K/32, 16)
    nibbles = torch.stack((blocks & 15, blocks >> 4), -1).flatten(1)  # (2I, K)
    held = quant.unpack_codes(experts.gate_up_proj[3], 4)
    half = nibbles.shape[0] // 2
    assert torch.equal(held[:half], nibbles[0::2]) and torch.equal(held[half:], nibbles[1::2])


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t["model.layers.1.mlp.experts.down_proj_scales"].view(-1)[5].fill_(255),
            r"layers.1.mlp.experts.down_proj: an MXFP4 scale is e8m0's NaN",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(6, 128, 3).byte()}
            ),
            r"gate_up_proj: MXFP4 blocks \(6, 128, 2, 16\) and scales \(6, 128, 3\) do not match",
        ),
        (
            lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"),
            r"layers.0.mlp.experts.down_proj",
        ),
    ],
    ids=["nan-scale", "misshaped-scales", "missing-scales"],
)
def test_malformed_mxfp4_is_refused_by_name(mxfp4_dir, tmp_path, edit, match):
    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(bad), max_model_len=64, enforce_eager=True)
