"""A full-precision checkpoint quantized as it loads (``LLM(quantization="fp8" | "int8")``):
every parameter equal to the one served from the same weights' llm-compressor release
(``tests.quant_act_checkpoints``: FP8_DYNAMIC, and W8A8's weights for int8's W8A16), the
logits those of transformers on the dequantized weights (with FP8's per-token input
quantization), the LM head dense, and a snapshot keyed apart from the full-precision one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import hf_logits, random_prompts
from tests.quant_act_checkpoints import reference_model, write_act_quantized
from tests.test_engine_vs_hf import _engine_logits
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.models.layers.quant_linear import QuantExperts, QuantMethod

CASES = {  # name -> (model kind, quantization, the release it equals)
    "fp8-dense": ("qwen3", "fp8", ("ct-fp8", "dynamic")),
    "int8-moe": ("qwen3_moe", "int8", ("ct-w8a8", "dynamic")),  # NOTE: hooks miss fused experts
    "int8-dense": ("mistral", "int8", ("ct-w8a8", "dynamic")),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_model_len=128, block_size=4, num_kv_blocks=64, enforce_eager=True)


@pytest.fixture(scope="module")
def release(tiny_model_dir, tmp_path_factory):
    """case -> (dense dir, release dir, reference dir)."""
    root, built = tmp_path_factory.mktemp("online"), {}

    def build(case: str) -> tuple[Path, Path, Path]:
        if case not in built:
            kind, _, (fmt, variant) = CASES[case]
            dense, out, ref = tiny_model_dir(kind), root / case, root / f"{case}-ref"
            write_act_quantized(dense, out, ref, fmt, variant=variant, seed=2)
            built[case] = dense, out, ref
        return built[case]

    return build


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_at_load_equals_the_release_and_its_reference(case, release, hf_model):
    dense, out, ref = release(case)
    quantization = CASES[case][1]
    online = LLM(str(dense), quantization=quantization, **ENGINE)
    model = online.engine.runner.model
    quantized = [n for n, m in model.named_modules() if _quantized(m)]
    assert len(quantized) >= 4 and "lm_head" not in quantized
    assert not any(".gate" == n[-5:] for n in quantized), "routers stay dense"
    ours = dict(model.named_parameters())
    theirs = dict(LLM(str(out), **ENGINE).engine.runner.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():  # NOTE: the same codes and scales, bit for bit
        assert p.dtype == theirs[name].dtype and torch.equal(p, theirs[name]), name
    tokens = random_prompts([40], VOCAB_SIZE, seed=3)[0]
    if quantization == "fp8":  # NOTE: the reference quantizes each linear's input per token
        with torch.no_grad():
            want = reference_model(ref, out)(torch.tensor([tokens])).logits[0]
    else:
        want = hf_logits(hf_model(ref), tokens)
    got = _engine_logits(online, tokens, 7)
    assert (got - want).abs().max() / want.abs().max() < 1e-3


def _quantized(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "method", None), (QuantMethod, QuantExperts))


def test_the_quantized_image_is_keyed_apart_and_restores(release, tmp_path):
    dense, _, _ = release("fp8-dense")
    store = str(tmp_path / "store")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 21], VOCAB_SIZE, seed=4)]
    cold = LLM(str(dense), quantization="fp8", snapshot_store=store, **ENGINE)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]
    del cold
    warm = LLM(str(dense), quantization="fp8", snapshot_store=store, **ENGINE)
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info.reason
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == expected
    assert any(map(_quantized, warm.engine.runner.model.modules()))
    del warm
    full = LLM(str(dense), snapshot_store=store, **ENGINE)
    assert full.engine.start_info.path != "restored_image"
    assert not any(map(_quantized, full.engine.runner.model.modules()))


def test_at_load_quantization_is_refused_on_a_quantized_checkpoint(release):
    _, out, _ = release("fp8-dense")  # NOTE: compressed-tensors FP8
    with pytest.raises(UnsupportedModelError, match="contradicts the checkpoint's quant_method"):
        LLM(str(out), quantization="int8", **ENGINE)
    with pytest.raises(UnsupportedModelError, match="is not one of auto, .*int8"):
        LLM(str(out), quantization="int4", **ENGINE)
