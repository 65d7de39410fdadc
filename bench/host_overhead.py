"""Host work per decode step: what a fast GPU waits for when the host falls behind.

The sync loop on a model so small that its forward costs little; host ms per step =
(wall - device busy) / steps over steady decode, batch 64, growing context. Compares the
current tree with older revisions (``--compare-rev REV ...``, each checked out in a git
worktree) in the same run, alternating, median of ``--repeats``. Writes
``docs/benchmarks/host_overhead.{json,md,png}``.

Run from the repository root: ``python -m bench.host_overhead --compare-rev REV [REV ...]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import tempfile
from pathlib import Path

# NOTE: this file runs in children against older trees: it imports nothing from bench/ at
# module level (an older tree's bench/ may lack it), hence these two here
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BATCH = 64
NEW_TOKENS = 48


def measure(context: int) -> float:
    """Host ms per decode step (runs in a child: ``warmboot`` comes from its PYTHONPATH)."""
    import torch

    from warmboot import LLM, SamplingParams
    from warmboot.engine.loop import BubbleMeter  # in every compared tree
    from warmboot.models.demo import write_random_llama
    from warmboot.tokenizer.train import train_tokenizer

    model = Path(tempfile.mkdtemp(prefix="wb-host-")) / "model"
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    shape |= dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=4096)
    write_random_llama(
        model,
        **shape,
        tie_word_embeddings=True,
        seed=0,
        dtype="float32",
        max_position_embeddings=context + NEW_TOKENS,
    )
    train_tokenizer(model, 4096)
    llm = LLM(
        str(model),
        max_model_len=context + NEW_TOKENS,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * context,
        num_kv_blocks=BATCH * (context + NEW_TOKENS) // 16 + BATCH,
        pipelined=False,
        cpu_threads=1,
    )
    g = torch.Generator().manual_seed(context)
    prompts = [
        {"prompt_token_ids": torch.randint(1, 4096, (context,), generator=g).tolist()}
        for _ in range(BATCH)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm
    llm.engine.block_manager.reset_prefix_cache()
    # NOTE: as the server does once its engine is up (EngineHolder): otherwise a full
    # collection over the booted engine lands in some runs' measured steps and not others
    # (0.8 vs 2.4 ms/step at 128 tokens for the same tree)
    gc.collect()
    gc.freeze()
    meter = BubbleMeter()
    if hasattr(llm.engine.loop, "meter"):  # NOTE: the loop owns its meter since the restructure
        llm.engine.loop.meter = meter
    else:
        llm.engine.meter = meter
    llm.generate(prompts, params)
    return (meter.wall - meter.busy) / meter.steps * 1e3


def run_child(tree: Path, context: int) -> float:
    from bench.common import child_json

    return float(
        child_json(
            [str(Path(__file__).resolve()), "--child", str(context)], tree, OMP_NUM_THREADS="1"
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compare-rev", nargs="*", default=[], help="older revisions to compare")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child is not None:
        print(measure(args.child))
        return
    from bench.common import revision_trees
    from bench.timing import interleaved

    with revision_trees(ROOT, args.compare_rev) as trees:
        rows = []
        for context in args.contexts:
            runs = {
                name: functools.partial(run_child, tree, context) for name, tree in trees.items()
            }
            samples = interleaved(args.repeats, runs)
            row = {"context": context} | {n: statistics.median(v) for n, v in samples.items()}
            print(row, flush=True)
            rows.append(row)
    write_report(args, list(trees), rows)


def write_report(args, names: list[str], rows: list[dict]) -> None:
    # NOTE: imported here: a child runs this file against an older tree that may lack it
    from bench.common import pyplot, report_meta, save_report

    plt = pyplot()
    meta = report_meta(batch=BATCH, new_tokens=NEW_TOKENS, repeats=args.repeats)
    head = "| context | " + " | ".join(f"{n} ms/step" for n in names) + " |"
    lines = [
        "# Host work per decode step",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.host_overhead"
        f" --compare-rev {' '.join(names[:-1])}`: sync loop, batch {BATCH}, {NEW_TOKENS} new tokens, a"
        " one-layer model (the forward costs little), the garbage collector frozen after warm-up as in the server; host ms per step = (wall - device busy)"
        f" / steps over steady decode, median of {args.repeats}, the trees alternating.",
        "",
        head,
        "|" + " ---: |" * (len(names) + 1),
    ]
    for r in rows:
        lines.append(f"| {r['context']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for n in names:
        ax.plot([r["context"] for r in rows], [r[n] for r in rows], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens per sequence (batch 64)")
    ax.set_ylabel("host ms per decode step")
    ax.set_title(f"host work per step, {meta['date']}")
    ax.legend()
    save_report(args.out, "host_overhead", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
