"""Checkpoints whose activations are quantized too (W8A8 int8, FP8 per tensor/channel/block,
DeepSeek's 128x128 FP8 blocks) against transformers on the dequantized weights with the
format's activation quantization as pre-hooks (``tests.quant_act_checkpoints``: checked against
compressed-tensors' own quantized forward, DeepSeek's kernel formula for the blocks). A
dynamic activation quantization turns float differences of 1e-7 upstream into a whole code
step here and there, and a flip in a K or V input moves every later position by its worth:
the logits are held to "a third of the positions within 1e-4, none off by more than a flip"
(without the activation quantization none is within 1e-4), greedy tokens to exact agreement,
and the activation quantization itself to bit-exact agreement with the reference's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import hf_greedy, random_prompts
from tests.quant_act_checkpoints import (
    input_quantizers,
    make_block_model,
    reference_model,
    write_act_quantized,
)
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.kernels.act_quant import fake_quant

CASES = {  # name -> (model kind or "block", format, variant)
    "w8a8-int8-dynamic": ("qwen2", "ct-w8a8", "dynamic"),
    "w8a8-int8-static": ("mistral", "ct-w8a8", "static"),
    "fp8-dynamic": ("qwen3", "ct-fp8", "dynamic"),
    "fp8-static": ("mistral", "ct-fp8", "static"),
    "fp8-block-ct": ("block", "ct-fp8", "block"),
    "fp8-block": ("block", "fp8-block", "float"),
    "fp8-block-ue8m0": ("block", "fp8-block", "ue8m0"),
}


@pytest.fixture(scope="module")
def act_quantized(tiny_model_dir, tmp_path_factory):
    root, built = tmp_path_factory.mktemp("act-quantized"), {}

    def build(case: str) -> tuple[Path, torch.nn.Module]:
        if case not in built:
            kind, fmt, variant = CASES[case]
            if kind == "block":
                dense = root / "block-dense"
                if not dense.is_dir():
                    make_block_model(dense)
            else:
                dense = tiny_model_dir(kind)
            out, ref = root / case, root / f"{case}-ref"
            write_act_quantized(dense, out, ref, fmt, variant=variant, seed=2)
            built[case] = out, reference_model(ref, out)
        return built[case]

    return build


@pytest.mark.parametrize("case", list(CASES))
def test_activation_quantized_checkpoints_match_their_reference(case, act_quantized):
    from tests.test_engine_vs_hf import _engine_logits

    path, hf = act_quantized(case)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64, enforce_eager=True)
    tokens = random_prompts([40], VOCAB_SIZE, seed=3)[0]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    for chunk in (7, 40):
        err = _logprob_errors(_engine_logits(llm, tokens, chunk), want)
        exact = (err < 1e-4).float().mean()
        assert exact >= 0.35, f"{case}, chunks of {chunk}: {exact:.0%} of positions within 1e-4"
        assert err.max() < 0.25, f"{case}, chunks of {chunk}: logprob error {err.max():.2e}"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts((9, 23), VOCAB_SIZE, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def _logprob_errors(ours: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position, the largest logprob difference (a code flip moves a few positions)."""
    return (ours.log_softmax(-1) - want.log_softmax(-1)).abs().amax(-1)


def test_without_the_activation_quantization_the_logits_differ(act_quantized):
    """The check above can fail: the reference's hooks move the logits by far more than its
    tolerance, so an engine that skipped the activation quantization would be caught."""
    from tests.test_engine_vs_hf import _engine_logits

    path, hf = act_quantized("w8a8-int8-dynamic")
    tokens = random_prompts([40], VOCAB_SIZE, seed=3)[0]
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=64, enforce_eager=True)
    ours = _engine_logits(llm, tokens, 40)
    for handle in hf.act_quant_handles:
        handle.remove()
    with torch.no_grad():
        plain = hf(torch.tensor([tokens])).logits[0]
    assert (_logprob_errors(ours, plain) < 1e-4).float().mean() < 0.25


def test_the_kernel_rule_floors_amax_and_rounds_ue8m0_scales_up():
    x = torch.zeros(1, 128)
    x[0, 0] = 1e-6  # NOTE: below DeepSeek's 1e-4 floor: scale 1e-4 / 448, not 1e-6 / 448
    s = torch.tensor(1e-4) / 448
    floored = (x[0, 0] / s).to(torch.float8_e4m3fn).float() * s
    assert floored != x[0, 0]  # NOTE: without the floor x / s = 448 exactly: x itself
    assert fake_quant(x, "fp8", "group", 128, "kernel")[0, 0] == floored
    x[0, 0] = 3.0
    s = 2.0 ** torch.ceil(torch.log2(torch.tensor(3.0 / 448)))
    expected = (torch.tensor(3.0) / s).to(torch.float8_e4m3fn).float() * s
    assert fake_quant(x, "fp8", "group", 128, "kernel", ue8m0=True)[0, 0] == expected


@pytest.mark.parametrize("case", list(CASES))
def test_the_input_quantization_is_the_references_bit_for_bit(case, act_quantized):
    path, _ = act_quantized(case)
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=16, enforce_eager=True)
    layer = llm.engine.runner.model.layers[0]
    refs = input_quantizers(path)
    g = torch.Generator().manual_seed(7)
    for ours, theirs in ((layer.self_attn.qkv_proj, "q_proj"), (layer.mlp.down_proj, "down_proj")):
        x = torch.randn(6, ours.in_features, generator=g) * torch.rand(6, 1, generator=g) * 4
        x[1] = 0.0  # NOTE: a zero row: the eps scale
        x[2, 3] = 60.0  # NOTE: an outlier past a static scale: the clamp
        want = refs[f"model.layers.0.{'self_attn' if theirs == 'q_proj' else 'mlp'}.{theirs}"](x)
        got = ours.method.quantize_input(x, ours.input_scale)
        assert torch.equal(got, want), f"{case}: {theirs} input differs"
