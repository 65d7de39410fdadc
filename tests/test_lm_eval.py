"""lm-eval (0.4.13, its own venv: ``make test`` builds ``.venv-lmeval``) drives a real warmboot
server with its ``local-completions`` model and remote tokenizer (``/tokenize``,
``/detokenize``, ``/tokenizer_info``) on a multiple-choice task and a perplexity task over
data the tests ship. Every loglikelihood lm-eval logged is checked against transformers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.server_harness import MODEL_NAME, running_server, tiny_llm
from warmboot.server.engine_holder import EngineHolder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "lm_eval" / "data"
LMEVAL_PYTHON = Path(os.environ.get("WARMBOOT_LMEVAL_PYTHON", ROOT / ".venv-lmeval/bin/python"))
TOL = 1e-3  # a sum of a few fp32 logprobs, each within 1e-4

CHOICE_TASK = """task: wb_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
PPL_TASK = """task: wb_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/text.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


def _run_lm_eval(url: str, tmp: Path) -> tuple[dict, dict[str, list[dict]]]:
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "wb_choice.yaml").write_text(CHOICE_TASK.format(data=DATA))
    (tasks / "wb_ppl.yaml").write_text(PPL_TASK.format(data=DATA))
    model_args = (
        f"base_url={url}/v1/completions,model={MODEL_NAME},tokenizer_backend=remote,"
        "num_concurrent=2,max_retries=1,max_length=256"
    )
    options = {
        "--model": "local-completions",
        "--model_args": model_args,
        "--tasks": "wb_choice,wb_ppl",
        "--include_path": str(tasks),
        "--output_path": str(tmp / "out"),
    }
    cmd = [str(LMEVAL_PYTHON), "-m", "lm_eval", *(a for pair in options.items() for a in pair)]
    cmd.append("--log_samples")
    env = dict(os.environ, HF_HOME=str(tmp / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (tmp / "out").rglob("results_*.json")
    samples = {}
    for task in ("wb_choice", "wb_ppl"):
        (path,) = (tmp / "out").rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(results.read_text())["results"], samples


def _logprob(hf, context: list[int], continuation: list[int]) -> float:
    """transformers' log P(continuation | context)."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        lsm = torch.log_softmax(hf(ids).logits[0].double(), dim=-1)
    start = len(context)
    return sum(float(lsm[start - 1 + i, t]) for i, t in enumerate(continuation))


def _split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing spaces move to the continuation; the
    continuation's tokens are the whole string's past the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


@pytest.mark.skipif(
    not LMEVAL_PYTHON.exists(),
    reason=f"lm-eval venv missing: {LMEVAL_PYTHON} (make test builds it)",
)
def test_lm_eval_multiple_choice_and_perplexity(path, hf, tmp_path):
    llm = tiny_llm(path, max_num_seqs=8)
    tok = llm.engine.tokenizer
    with running_server(EngineHolder.ready(llm.engine)) as url:
        results, samples = _run_lm_eval(url, tmp_path)
    correct = 0
    for s in samples["wb_choice"]:
        ours = [float(r[0][0]) for r in s["resps"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        ref = [_logprob(hf, *_split(tok, context, choice)) for context, choice in pairs]
        assert all(abs(a - b) < TOL for a, b in zip(ours, ref, strict=True)), (ours, ref)
        correct += max(range(len(ref)), key=ref.__getitem__) == int(s["target"])
    assert results["wb_choice"]["acc,none"] == pytest.approx(correct / len(samples["wb_choice"]))
    lls, words = 0.0, 0
    eos = tok.eos_token_id
    for s in samples["wb_ppl"]:
        text = s["doc"]["text"]
        ref = _logprob(hf, [eos], tok.encode(text, add_special_tokens=False))
        assert abs(float(s["resps"][0][0]) - ref) < TOL
        lls += ref
        words += len(re.split(r"\s+", text))
    assert results["wb_ppl"]["word_perplexity,none"] == pytest.approx(
        math.exp(-lls / words), rel=1e-3
    )
