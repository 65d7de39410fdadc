"""Prefix caching for a hybrid model (issue 52): time to first token when prompts share a
prefix, with the states kept at block boundaries (``core.state_prefix``), without them
(``state_checkpoints=0``: every prompt computed in full), and for the attention-only twin
(its KV prefix cache alone).

The models are ``bench.hybrid``'s (random Qwen3.5-shaped checkpoints, the hybrid 3 gated
DeltaNet layers to 1 gated attention layer). Two workloads, each request after the last has
finished (steady state: engines built and compiled first; a request's TTFT is from its
``generate_stream`` call to its first token):
- a shared system prompt (``--system`` tokens) and four questions of 32 tokens each;
- a conversation: its second turn is the first turn's prompt and answer plus 32 tokens.

    python -m bench.hybrid_prefix [--rounds 2] [--system 1500] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report
from bench.hybrid import build

QUESTION = 32
ANSWER = 16
ENGINES = {
    "hybrid, kept states": ("hybrid", None),
    "hybrid, none kept": ("hybrid", 0),
    "attention-only twin": ("attention-only twin", None),
}


def engine(path: Path, max_len: int, dtype: str, checkpoints: int | None):
    from warmboot import LLM

    llm = LLM(
        str(path), dtype=dtype, max_model_len=max_len, max_num_seqs=1, state_checkpoints=checkpoints
    )
    llm.engine.wait_compiled()
    return llm


def first_token(llm, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens generated)."""
    from warmboot import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, output_kind="delta")
    t0, ttft, tokens = time.perf_counter(), None, []
    for out in llm.generate_stream({"prompt_token_ids": prompt}, params):
        ttft = ttft or time.perf_counter() - t0
        tokens += out.outputs[0].delta_token_ids
    return ttft, tokens


def workloads(llm, system: int, seed: int) -> dict[str, list[float]]:
    """TTFT per request of each workload (fresh tokens per round: no earlier round's cache)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    shared = tokens(system)
    chat = [first_token(llm, shared + tokens(QUESTION), 2)[0] for _ in range(4)]
    turn1 = tokens(system) + tokens(QUESTION)
    ttft1, answer = first_token(llm, turn1, ANSWER)
    ttft2 = first_token(llm, turn1 + answer + tokens(QUESTION), 2)[0]
    return {"system prompt": chat, "conversation": [ttft1, ttft2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wb-hybrid-prefix-"))
    paths = {name: build(name, root) for name in ("hybrid", "attention-only twin")}
    max_len = 2 * args.system + 4 * QUESTION + ANSWER
    engines = {
        label: engine(paths[model], max_len, args.dtype, kept)
        for label, (model, kept) in ENGINES.items()
    }
    runs: dict[str, list[dict]] = {label: [] for label in engines}
    for r in range(args.rounds):
        for label in engines if r % 2 == 0 else reversed(engines):
            runs[label].append(workloads(engines[label], args.system, seed=r))
    hits = {label: llm.stats()["state_prefix_hits"] for label, llm in engines.items()}
    meta = report_meta(system=args.system, question=QUESTION, answer=ANSWER, dtype=args.dtype)
    report(meta | {"state_prefix_hits": hits}, runs, args.out)


def _median(runs: list[dict], workload: str, i: int) -> float:
    return statistics.median(run[workload][i] for run in runs)


def report(meta: dict, runs: dict[str, list[dict]], out: Path) -> None:
    s = meta["system"]
    lines = [
        "# Prefix caching for a hybrid model (issue 52)",
        "",
        f"{meta['date']}, {meta['machine']}. `bench.hybrid`'s random Qwen3.5-shaped checkpoints "
        f"in {meta['dtype']}, compiled, batch 1. `python -m bench.hybrid_prefix`.",
        "",
        f"Time to first token (ms, median of {len(next(iter(runs.values())))} rounds, each in "
        f"the JSON) of four requests sharing a {s}-token system prompt, each with its own "
        f"{QUESTION}-token question, one after another; then a conversation whose second turn "
        f"extends the first ({s + QUESTION} prompt tokens, {ANSWER} answered) by {QUESTION}.",
        "",
        "| engine | 1st | 2nd | 3rd | 4th | turn 1 | turn 2 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for label, label_runs in runs.items():
        chat = [_median(label_runs, "system prompt", i) * 1e3 for i in range(4)]
        conv = [_median(label_runs, "conversation", i) * 1e3 for i in range(2)]
        lines.append(f"| {label} | " + " | ".join(f"{v:.0f}" for v in chat + conv) + " |")
        rows.append({"engine": label, "rounds": label_runs})
    lines += [
        "",
        "The hybrid resumes from the latest state an earlier request kept at or before the",
        "block where it leaves the shared tokens. The 1st request keeps one at each prefill",
        "chunk's end (512 tokens here, `long_prefill_token_threshold`'s default; one row per",
        "request, moving on) and at its prompt's last block, but none where the system prompt",
        "ends (nothing says where that is): the 2nd resumes from the 1st's last chunk end",
        "before it (1024 here; all of it when the prompt is a whole number of chunks), computes",
        "the rest and keeps its state where it left the 1st's tokens; the 3rd and 4th resume",
        "there. A conversation's next turn resumes from the last block its answer passed.",
        f"Requests that started from a kept state: {meta['state_prefix_hits']}.",
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, label_runs in runs.items():
        chat = [_median(label_runs, "system prompt", i) * 1e3 for i in range(4)]
        ax.plot(range(1, 5), chat, marker="o", label=label)
    ax.set(xlabel="request sharing the system prompt", ylabel="TTFT (ms)", yscale="log")
    ax.set_title(f"{s}-token shared system prompt")
    ax.legend()
    save_report(out, "hybrid_prefix", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
