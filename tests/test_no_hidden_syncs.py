"""The step path must not synchronise with the device. On the CPU nothing can sync, so this
test looks for the code patterns that do on CUDA, while a pipelined engine decodes a batch
mixing greedy, seeded top-k/top-p, penalties, logprobs, logit bias, suppressed stop ids and a
JSON schema:

- a Python list (or a list inside a tuple) as the index of a tensor: a blocking copy of the
  index to the device;
- ``torch.tensor(..., device=...)`` / ``torch.as_tensor(..., device=...)``: a blocking copy;
- ``torch.bincount``: reads its input's max back to the host.

bench/gpu_check.py checks the real thing on a GPU (torch's sync debug mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.sampling_params import StructuredOutputs

STEP_PATH = tuple(
    str(Path(__file__).resolve().parents[1] / "warmboot" / d)
    for d in ("engine", "kernels", "models")
)


def _caller_in_step_path() -> str | None:
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    return f"{Path(name).name}:{frame.f_lineno}" if name.startswith(STEP_PATH) else None


def _has_list(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


def test_no_sync_patterns_in_the_step_path(path, monkeypatch):
    hits: list[tuple[str, str]] = []
    get, set_ = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    tensor, as_tensor, bincount = torch.tensor, torch.as_tensor, torch.bincount

    def getitem(self, index):
        if _has_list(index) and (where := _caller_in_step_path()):
            hits.append(("list index", where))
        return get(self, index)

    def setitem(self, index, value):
        if _has_list(index) and (where := _caller_in_step_path()):
            hits.append(("list index", where))
        return set_(self, index, value)

    def make(fn, name):
        def wrapped(*args, **kw):
            if kw.get("device") is not None and (where := _caller_in_step_path()):
                hits.append((f"{name}(device=)", where))
            return fn(*args, **kw)

        return wrapped

    def counted(*args, **kw):
        if where := _caller_in_step_path():
            hits.append(("bincount", where))
        return bincount(*args, **kw)

    llm = LLM(
        str(path),
        max_model_len=128,
        block_size=4,
        num_kv_blocks=256,
        pipelined=True,
        cpu_threads=1,
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=12),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),  # unseeded random
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            logprobs=2,
            max_tokens=12,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=0.0,
            min_tokens=4,
            stop_token_ids=[7],
            max_tokens=12,
            logit_bias={5: 2.0, 9: -3.0},
        ),
        SamplingParams(
            temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(json=schema)
        ),
    ]
    prompts = [{"prompt_token_ids": [(5 * i + j) % VOCAB_SIZE for j in range(9)]} for i in range(6)]
    llm.generate(prompts, kinds)  # warm: grammar compile, first-use paths
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    monkeypatch.setattr(torch, "tensor", make(tensor, "tensor"))
    monkeypatch.setattr(torch, "as_tensor", make(as_tensor, "as_tensor"))
    monkeypatch.setattr(torch, "bincount", counted)
    outs = llm.generate(prompts, kinds)
    monkeypatch.undo()
    assert all(o.outputs[0].token_ids for o in outs)
    assert hits == [], sorted(set(hits))
