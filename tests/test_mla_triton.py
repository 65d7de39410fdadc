"""MLA on the Triton kernels (interpreter): the latent cache read as MQA keys and values
(one KV head, Dv = Dk = kv_lora_rank + rope = 64) gives the torch backend's greedy tokens;
an entry wider than the kernels' 256 is refused when the model loads."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import pytest  # noqa: E402

from tests.helpers import random_prompts  # noqa: E402
from tests.tiny_models import VOCAB_SIZE  # noqa: E402
from warmboot import LLM, SamplingParams  # noqa: E402
from warmboot.kernels.backend import KVLayout  # noqa: E402
from warmboot.kernels.triton_backend import TritonAttentionBackend  # noqa: E402


def _greedy(path, backend: str, prompts) -> list[list[int]]:
    llm = LLM(
        str(path),
        max_model_len=64,
        block_size=4,
        num_kv_blocks=48,
        max_num_batched_tokens=16,
        max_num_seqs=3,
        attention_backend=backend,
        enforce_eager=True,
    )
    assert llm.engine.facts.attention_backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # the engine on Triton kernels in the interpreter
def test_mla_greedy_matches_torch_backend(tiny_model_dir):
    path = tiny_model_dir("deepseek_v3")
    prompts = random_prompts([21, 3], VOCAB_SIZE, seed=13)
    prompts.append(prompts[0][:12] + [7, 8])  # prefill over cached blocks (a prefix hit)
    assert _greedy(path, "triton", prompts) == _greedy(path, "torch", prompts)


def test_triton_refuses_deepseeks_576_wide_latent():
    backend = TritonAttentionBackend()
    backend.check_layout(KVLayout(1, 1, 64), num_heads=4)
    with pytest.raises(ValueError, match="576 wide"):
        backend.check_layout(KVLayout(1, 1, 512 + 64), num_heads=128)
