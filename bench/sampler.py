"""The sampler's cost per decode step: penalties as histories grow, and top-k / top-p.

Three figures, each for the current tree and an older revision (``--compare-rev``, checked
out in a git worktree) in the same run, alternating, median of ``--repeats``:

- penalties, the sampler alone: batch 64, vocab 32k, every row penalised, histories (prompt
  and output) of 16 to 4096 tokens each, passed as the runner passes them (lists before
  ``TokenHistory`` existed, its tensors after); ms per call;
- filters, the sampler alone: batch 64, vocab 32k, temperature 0.8 with top-k 50, top-p 0.9
  or both; ms per call;
- the engine: a one-layer model with a 32k vocabulary (so the sampler weighs), batch 64,
  256-token prompts, 384 new tokens with penalties, greedy; output tokens per second.

On the CPU the "device" is this CPU, so both figures include the device's work. Writes
``docs/benchmarks/sampler.{json,md,png}``.

Run from the repository root: ``python -m bench.sampler --compare-rev REV``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

# NOTE: this file runs in children against older trees: it imports nothing from bench/ at
# module level (an older tree's bench/ may lack it), hence these two here
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BATCH = 64
VOCAB = 32000
LENGTHS = (16, 256, 1024, 4096)
CONFIGS = {
    "freq+presence": dict(frequency_penalty=0.5, presence_penalty=0.3),
    "all three": dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1),
}
FILTERS = {
    "top-k 50": dict(top_k=50),
    "top-p 0.9": dict(top_p=0.9),
    "top-k 50, top-p 0.9": dict(top_k=50, top_p=0.9),
}
PROMPT, NEW = 256, 384


def sampler_ms() -> dict[str, float]:
    """{"L/config": ms per sampler call} (runs in a child: ``warmboot`` from its PYTHONPATH)."""
    import torch

    from warmboot.device import sampler as S
    from warmboot.sampling_params import SamplingParams

    torch.set_num_threads(1)
    history = getattr(S, "TokenHistory", None)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, VOCAB, generator=g)
    out = {}
    for length in LENGTHS:
        for name, kw in CONFIGS.items():
            p = SamplingParams(temperature=0.0, **kw)
            rows = []
            for _ in range(BATCH):
                ids = torch.randint(0, VOCAB, (2, length), generator=g).tolist()
                if history is not None:  # what the runner passes since TokenHistory exists
                    ids = [_as_history(history(), h) for h in ids]
                rows.append(S.SamplingRow(p, ids[0], ids[1], None))
            S.Sampler()(logits, rows)  # warm
            calls = max(3, int(20 * 256 / max(length, 256)))
            t = time.perf_counter()
            for _ in range(calls):
                S.Sampler()(logits, rows)
            out[f"{length}/{name}"] = (time.perf_counter() - t) / calls * 1e3
    for name, kw in FILTERS.items():
        rows = [S.SamplingRow(SamplingParams(temperature=0.8, **kw), [], [], None)] * BATCH
        S.Sampler()(logits, rows)  # warm
        t = time.perf_counter()
        for _ in range(10):
            S.Sampler()(logits, rows)
        out[f"filter/{name}"] = (time.perf_counter() - t) / 10 * 1e3
    return out


def engine_tok_s() -> float:
    """Output tokens/s of a penalised greedy batch (runs in a child)."""
    import torch

    from warmboot import LLM, SamplingParams
    from warmboot.models.demo import write_random_llama
    from warmboot.tokenizer.train import train_tokenizer

    model = Path(tempfile.mkdtemp(prefix="wb-pen-")) / "model"
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    shape |= dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB)
    write_random_llama(
        model,
        **shape,
        tie_word_embeddings=True,
        seed=0,
        dtype="float32",
        max_position_embeddings=PROMPT + NEW,
    )
    train_tokenizer(model, 4096)
    llm = LLM(
        str(model),
        max_model_len=PROMPT + NEW,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT,
        num_kv_blocks=BATCH * (PROMPT + NEW) // 16 + BATCH,
        cpu_threads=1,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(1, 4096, (PROMPT,), generator=g).tolist()}
        for _ in range(BATCH)
    ]
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, **CONFIGS["all three"]
    )
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_child(tree: Path, what: str):
    from bench.common import child_json

    return child_json([str(Path(__file__).resolve()), "--child", what], tree, OMP_NUM_THREADS="1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", choices=("sampler", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--compare-rev", required=False, help="older revision to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(sampler_ms() if args.child == "sampler" else engine_tok_s()))
        return
    if not args.compare_rev:
        ap.error("--compare-rev is required")
    from bench.common import revision_trees

    with revision_trees(ROOT, [args.compare_rev]) as trees:
        samples = {name: {"sampler": [], "engine": []} for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                for what in ("sampler", "engine"):
                    samples[name][what].append(run_child(tree, what))
                print(name, samples[name]["engine"][-1], flush=True)
    write_report(args, list(trees), samples)


def _as_history(history, ids: list[int]):
    """``ids`` as the runner's history tensor (``extend``; older trees had ``sync``)."""
    if hasattr(history, "extend"):
        history.extend(ids)
        return history.tensor
    return history.sync(ids)


def write_report(args, names: list[str], samples: dict) -> None:
    from bench.common import pyplot, report_meta, save_report

    old, new = names
    med = {
        n: {
            k: statistics.median(s[k] for s in samples[n]["sampler"])
            for k in samples[n]["sampler"][0]
        }
        for n in names
    }
    tok_s = {n: statistics.median(samples[n]["engine"]) for n in names}
    rows = [
        {"history": int(k.split("/")[0]), "config": k.split("/")[1]} | {n: med[n][k] for n in names}
        for k in med[new]
        if not k.startswith("filter/")
    ]
    filters = [
        {"filter": k.split("/", 1)[1]} | {n: med[n][k] for n in names}
        for k in med[new]
        if k.startswith("filter/")
    ]
    meta = report_meta(batch=BATCH, vocab=VOCAB, repeats=args.repeats, engine_tok_s=tok_s)
    meta["filters"] = filters
    lines = [
        "# The sampler per decode step: penalties and filters",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.sampler --compare-rev {old}`,"
        f" median of {args.repeats}, both trees alternating, one torch thread.",
        "",
        f"Sampler alone, batch {BATCH}, vocab {VOCAB}, every row penalised; history = prompt"
        " and output length per row; ms per call:",
        "",
        f"| history | penalties | {old} ms | current ms | speed-up |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['history']} | {r['config']} | {r[old]:.1f} | {r[new]:.1f}"
            f" | {r[old] / r[new]:.2f}x |"
        )
    lines += [
        "",
        f"Filters, the sampler alone, batch {BATCH}, vocab {VOCAB}, temperature 0.8; ms per call:",
        "",
        f"| filter | {old} ms | current ms | speed-up |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in filters:
        lines.append(f"| {r['filter']} | {r[old]:.1f} | {r[new]:.1f} | {r[old] / r[new]:.2f}x |")
    lines += [
        "",
        f"Engine, one-layer model, vocab {VOCAB}, batch {BATCH}, {PROMPT}-token prompts,"
        f" {NEW} new tokens with all three penalties, greedy: {tok_s[old]:.0f} tok/s at {old},"
        f" {tok_s[new]:.0f} tok/s now ({tok_s[new] / tok_s[old]:.2f}x).",
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for cfg in CONFIGS:
        sel = [r for r in rows if r["config"] == cfg]
        for n, style in ((old, "--"), (new, "-")):
            ax.plot(
                [r["history"] for r in sel],
                [r[n] for r in sel],
                style,
                marker="o",
                label=f"{cfg}, {n}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("history tokens per row (prompt and output each)")
    ax.set_ylabel("sampler ms per step (batch 64)")
    ax.set_title(f"penalties in the sampler, vocab {VOCAB}, {meta['date']}")
    ax.legend(fontsize=7)
    save_report(args.out, "sampler", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
