"""Quantized checkpoints (weight-only int4/int8) against transformers on the dequantized
weights, fp32: each format's real layout (``tests.quant_checkpoints``), through chunked
prefill, preemption and prefix sharing, compiled and eager, and a snapshot restore; the
weights stay quantized in memory; what is malformed or not served is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import assert_engine_clean, hf_greedy, hf_logits, random_prompts
from tests.mxfp4_checkpoints import write_gpt_oss_mxfp4
from tests.quant_checkpoints import write_quantized
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.quant_linear import QuantExperts, QuantMethod

CASES = {
    "ct-pack-w4-g32-sym": ("mistral", "ct-pack", dict(bits=4, group_size=32, sym=True)),
    "ct-pack-w4-g16-asym": ("qwen2", "ct-pack", dict(bits=4, group_size=16, sym=False)),
    "ct-pack-w8-channel": ("qwen3", "ct-pack", dict(bits=8, group_size=None, sym=True)),
    "ct-int-w8-channel": ("llama_tied_mqa", "ct-int", dict(bits=8, group_size=None)),
    "gptq-w4-g32-act-order": ("mistral", "gptq", dict(bits=4, group_size=32, act_order=True)),
    "gptq-w8-g16-asym": ("qwen3", "gptq", dict(bits=8, group_size=16, sym=False)),
    "awq-w4-g16": ("qwen2", "awq", dict(bits=4, group_size=16, sym=False)),
    "gptq-w4-g16-moe": ("qwen3_moe", "gptq", dict(bits=4, group_size=16, act_order=True)),
    "ct-pack-w4-g32-head": ("mistral", "ct-pack", dict(bits=4, group_size=32, ignore=())),
    "mxfp4-gpt-oss": ("gpt_oss", "mxfp4", {}),
    "gptq-w4-g48-partial": (
        "mistral",
        "gptq",
        dict(bits=4, group_size=48, act_order=True, sym=False),
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """case -> (quantized dir, reference dir), written once per module."""
    root, built = tmp_path_factory.mktemp("quantized"), {}

    def build(case: str) -> tuple[Path, Path]:
        if case not in built:
            kind, fmt, args = CASES[case]
            out, ref = root / case, root / f"{case}-ref"
            if fmt == "mxfp4":  # NOTE: transformers reads MXFP4 itself: its own reference
                built[case] = (ref := write_gpt_oss_mxfp4(out, seed=1)), ref
                return built[case]
            write_quantized(tiny_model_dir(kind), out, ref, fmt, seed=1, **args)
            built[case] = out, ref
        return built[case]

    return build


def _logits(llm: LLM, tokens: list[int], chunk: int) -> torch.Tensor:
    from tests.test_engine_vs_hf import _engine_logits

    return _engine_logits(llm, tokens, chunk)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_the_dequantized_weights(case, quantized, hf_model):
    path, ref = quantized(case)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64, enforce_eager=True)
    modules = list(llm.engine.runner.model.modules())
    experts = [m for m in modules if isinstance(getattr(m, "method", None), QuantExperts)]
    assert sum(map(_quantized, modules)) + len(experts) >= 2
    if "moe" in case or "mxfp4" in case:
        assert experts
    if "head" in case:  # NOTE: a quantized LM head (the packed view leaves it to its method)
        assert _quantized(llm.engine.runner.model.lm_head)
    tokens = random_prompts([40], VOCAB_SIZE, seed=3)[0]
    want = hf_logits(hf_model(ref), tokens)
    for chunk in (7, 40):  # NOTE: decode-sized rows (the native kernel), and a whole prompt
        ours = _logits(llm, tokens, chunk)
        rel = (ours - want).abs().max() / want.abs().max()
        assert rel < 1e-4, f"{case}, chunks of {chunk}: relative logit error {rel:.2e}"
        logprobs = (ours.log_softmax(-1) - want.log_softmax(-1)).abs().max()
        assert logprobs < 1e-3


@pytest.mark.parametrize(
    "case",
    [
        "gptq-w4-g32-act-order",
        "ct-pack-w4-g16-asym",
        "gptq-w4-g16-moe",
        "mxfp4-gpt-oss",
        "gptq-w4-g48-partial",
    ],
)
def test_greedy_through_chunks_preemption_and_prefix_sharing(case, quantized, hf_model, step_mode):
    path, ref = quantized(case)
    prompts = random_prompts((5, 13, 31, 47, 2, 20), VOCAB_SIZE, seed=0)
    prompts += [prompts[3][:20] + p for p in random_prompts((9, 3), VOCAB_SIZE, seed=1)]
    want = [hf_greedy(hf_model(ref), p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(
        str(path),
        max_model_len=128,
        block_size=4,
        num_kv_blocks=36,
        max_num_batched_tokens=16,
        max_num_seqs=5,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if step_mode == "compiled":
        assert llm.engine.runner.served["compiled"] > 0
    assert_engine_clean(llm)


def test_weights_stay_quantized_in_memory_and_in_a_snapshot(quantized, tmp_path):
    """The codes held are the checkpoint's packed bytes (the tiny Mistral's rows are whole
    panels), and a snapshot stores and restores them as they lie."""
    path, _ = quantized("ct-pack-w4-g32-sym")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([11, 27], VOCAB_SIZE, seed=4)]
    store = tmp_path / "store"
    cold = LLM(str(path), max_model_len=128, snapshot_store=str(store), enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]
    quant = [m for m in cold.engine.runner.model.modules() if _quantized(m)]
    assert len(quant) == 2 * 4  # NOTE: qkv, o, gate_up and down of 2 layers
    held = sum(m.weight.numel() for m in quant)
    file = load_file(path / "model.safetensors")
    packed = sum(t.numel() * 4 for n, t in file.items() if n.endswith(".weight_packed"))
    assert held == packed and all(m.weight.dtype == torch.uint8 for m in quant)
    del cold
    warm = LLM(str(path), max_model_len=128, snapshot_store=str(store), enforce_eager=True)
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info.reason
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == expected
    (manifest,) = (store / "manifests").glob("*.json")
    dtypes = {t["name"]: t["dtype"] for t in json.loads(manifest.read_text())["tensors"]}
    assert dtypes["layers.0.mlp.down_proj.weight"] == "uint8"


def _quantized(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "method", None), QuantMethod)


def _broken(path: Path, tmp_path: Path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.scales"), r"model.layers.1.mlp.up_proj"),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.scales": torch.ones(3, 5)}),
            r"k_proj: scale is torch.float32 \(5, 3\), expected a float \(32, 2\) .*"
            r"scales \(3, 5\) torch.float32",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.self_attn.q_proj.qweight": torch.ones(2, 2, dtype=torch.float16)}
            ),
            r"q_proj.qweight is torch.float16, not an integer tensor",
        ),
        (
            lambda t: t.update(
                {"model.layers.1.self_attn.v_proj.g_idx": torch.arange(64, dtype=torch.int32) // 32}
            ),
            r"stacked projections have different input orders \(g_idx\)",
        ),
    ],
    ids=["missing-scale", "misshaped-scale", "float-codes", "stacked-g_idx-differ"],
)
def test_malformed_quantized_tensors_are_refused_by_name(edit, match, quantized, tmp_path):
    path, _ = quantized("gptq-w4-g32-act-order")
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(_broken(path, tmp_path, edit)), max_model_len=64, enforce_eager=True)


def test_a_quantization_argument_must_match_the_checkpoint(quantized, tiny_model_dir):
    from warmboot.server.engine_holder import unservable

    path, _ = quantized("awq-w4-g16")
    assert "contradicts the checkpoint's quant_method 'awq'" in unservable(str(path), "gptq")
    assert unservable(str(path), "awq_marlin") is None  # NOTE: vLLM's name for the same
    assert unservable(str(path), "auto") is None
    assert "contradicts" in unservable(str(path), "fp8")
    assert "contradicts the checkpoint's quant_method 'awq'" in unservable(str(path), "int8")
    dense = tiny_model_dir("mistral")
    assert unservable(str(dense), "fp8") is None  # NOTE: quantized at load
    assert "at load it can be quantized to fp8 or int8" in unservable(str(dense), "gptq")


@pytest.mark.parametrize("case", ["gptq-w4-g16-moe", "ct-pack-w8-channel", "mxfp4-gpt-oss"])
def test_a_bf16_engine_keeps_the_scales_and_runs_close_to_the_reference(case, quantized, hf_model):
    """bf16 rows through the native kernel's bf16 path; scales held as the checkpoint has
    them (GPTQ's fp16 is not rounded to bf16), experts' too."""
    path, ref = quantized(case)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64, enforce_eager=True)
    model = llm.engine.runner.model
    held = {n: p.dtype for n, p in model.named_parameters() if n.endswith("_scale")}
    want = {"gptq": torch.float16, "mxfp4": torch.bfloat16}.get(case[:5].rstrip("-"), torch.float32)
    assert held and set(held.values()) == {want}, held
    tokens = random_prompts([30], VOCAB_SIZE, seed=5)[0]
    ours = _logits(llm, tokens, 8)
    expected = hf_logits(hf_model(ref), tokens)
    theirs = hf_logits(hf_model(ref, "bfloat16"), tokens).float()  # NOTE: bf16's own error
    error = lambda x: ((x - expected).abs().max() / expected.abs().max()).item()  # noqa: E731
    agree = lambda x: (x.argmax(-1) == expected.argmax(-1)).float().mean().item()  # noqa: E731
    assert error(ours) < max(3e-2, 1.5 * error(theirs)), (error(ours), error(theirs))
    assert agree(ours) > min(0.9, agree(theirs) - 0.1), (agree(ours), agree(theirs))
