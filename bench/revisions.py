"""Decode speed and greedy tokens of the current tree against older revisions, same run.

For a change that must not change behaviour (a restructuring): each tree decodes the same
prompts with the sync and the pipelined loop at batch 1 and 16, greedy; the script reports
tokens/s per tree (median of ``--repeats``, the trees alternating) and whether every tree
produced the same tokens. Each revision runs from a git worktree in its own child process.
Writes ``docs/benchmarks/revisions.{json,md,png}``.

Run from the repository root: ``python -m bench.revisions --compare-rev REV [REV ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

# NOTE: this file runs in children against older trees: it imports nothing from bench/ at
# module level (an older tree's bench/ may lack it), hence these two here
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
PROMPT_LEN = 64
NEW_TOKENS = 64
BATCHES = (1, 16)
LOOPS = ("sync", "pipelined")
SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8192,
)


def measure(model: Path, loop: str, batch: int) -> dict:
    """One tree, one setting (in a child: ``warmboot`` comes from its PYTHONPATH)."""
    import torch

    from warmboot import LLM, SamplingParams

    llm = LLM(
        str(model),
        max_model_len=PROMPT_LEN + NEW_TOKENS,
        max_num_seqs=batch,
        pipelined=loop == "pipelined",
        cpu_threads=os.cpu_count(),
    )
    g = torch.Generator().manual_seed(batch)
    vocab = SHAPE["vocab_size"]
    prompts = [
        {"prompt_token_ids": torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    return {"tok_s": batch * NEW_TOKENS / wall, "tokens": digest}


def make_model() -> Path:
    from bench.checkpoints import random_llama

    kw = dict(tie_word_embeddings=True, max_position_embeddings=PROMPT_LEN + NEW_TOKENS)
    return random_llama("wb-revs-", SHAPE, **kw)


def run_child(tree: Path, model: Path, loop: str, batch: int) -> dict:
    from bench.common import child_json

    return child_json(
        [str(Path(__file__).resolve()), "--child", str(model), loop, str(batch)], tree
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compare-rev", nargs="+", required=False, default=[])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child is not None:
        model, loop, batch = args.child
        print(json.dumps(measure(Path(model), loop, int(batch))))
        return
    from bench.common import revision_trees

    model = make_model()
    with revision_trees(ROOT, args.compare_rev) as trees:
        rows = [
            run_setting(trees, model, loop, batch, args.repeats)
            for loop in LOOPS
            for batch in BATCHES
        ]
    write_report(args, list(trees), rows)


def run_setting(trees: dict[str, Path], model: Path, loop: str, batch: int, repeats: int):
    samples: dict[str, list[float]] = {name: [] for name in trees}
    digests: dict[str, set[str]] = {name: set() for name in trees}
    for _ in range(repeats):
        for name, tree in trees.items():
            r = run_child(tree, model, loop, batch)
            samples[name].append(r["tok_s"])
            digests[name].add(r["tokens"])
    row = {"loop": loop, "batch": batch}
    row |= {name: statistics.median(v) for name, v in samples.items()}
    row["same_tokens"] = len(set().union(*digests.values())) == 1
    print(row, flush=True)
    return row


def write_report(args, names: list[str], rows: list[dict]) -> None:
    from bench.common import pyplot, report_meta, save_report

    plt = pyplot()
    meta = report_meta(prompt=PROMPT_LEN, new_tokens=NEW_TOKENS, repeats=args.repeats, model=SHAPE)
    base = names[0]
    head = " | ".join(f"{n} tok/s" for n in names)
    lines = [
        "# Decode speed and tokens across revisions",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.revisions --compare-rev"
        f" {' '.join(names[:-1])}`: a random Llama ({SHAPE['num_hidden_layers']} layers,"
        f" hidden {SHAPE['hidden_size']}, vocab {SHAPE['vocab_size']}, fp32), prompt"
        f" {PROMPT_LEN}, {NEW_TOKENS} new tokens, greedy, offline `LLM.generate`; median of"
        f" {args.repeats}, the trees alternating; each tree in its own process.",
        "",
        f"| loop | batch | {head} | current / {base} | same tokens |",
        "| --- | ---: |" + " ---: |" * (len(names) + 1) + " --- |",
    ]
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f}" for n in names)
        ratio = r["current"] / r[base]
        lines.append(
            f"| {r['loop']} | {r['batch']} | {cells} | {ratio:.3f} |"
            f" {'yes' if r['same_tokens'] else 'NO'} |"
        )
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['loop']}\nbatch {r['batch']}" for r in rows]
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[n] for r in rows], width, label=n)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rows))], labels)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode speed by revision, {meta['date']}")
    ax.legend()
    save_report(args.out, "revisions", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
