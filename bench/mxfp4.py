"""GPT-OSS's MXFP4 experts against the same model in bf16: a random GPT-OSS-shaped model
(hidden 1024, 8 layers, 16 experts of 1024, top 4, GQA 16/4 heads, alternating 128-token
windows; the tiny test tokenizer's 512-token vocabulary, so the LM head is small and the
experts are what a step reads) written as the MXFP4 release stores it
(``tests/mxfp4_checkpoints``), served both ways by warmboot at steady state (bf16
activations), batch 1 and 8, 128-token prompts, 64 new tokens, greedy, rounds interleaved;
then each one's held weight bytes, snapshot image bytes and restore time. No peer: llama.cpp's
converter needs a real GPT-OSS tokenizer. Writes ``docs/benchmarks/mxfp4.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.checkpoints import prompts_for
from bench.common import pyplot, report_meta, save_report
from bench.quantized import OUT, _engine, _held_bytes, _warmboot, snapshot_costs
from warmboot.config import cache_root

SPEC = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    num_local_experts=16,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def model_dirs() -> dict[str, Path]:
    """The MXFP4 release and its dense original (written once under the cache)."""
    from tests.mxfp4_checkpoints import write_gpt_oss_mxfp4

    out = cache_root() / "models" / "gpt-oss-shaped-mxfp4"
    if not (out / "config.json").is_file():
        write_gpt_oss_mxfp4(out, seed=0, spec=SPEC)
    return {"bf16": out.with_name(out.name + "-dense"), "mxfp4": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--no-snapshots", action="store_true")
    args = p.parse_args()
    dirs = model_dirs()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {n: _engine(d, max(batches), args.prompt, None) for n, d in dirs.items()}
    held = {n: _held_bytes(llm) for n, llm in engines.items()}
    runs: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for batch in batches:
            prompts = prompts_for(batch, args.prompt, 512, seed=r)
            for name, llm in engines.items():
                runs.setdefault((name, batch), []).append(_warmboot(llm, prompts, args.new))
    del engines
    snaps = {} if args.no_snapshots else {n: snapshot_costs(d) for n, d in dirs.items()}
    report(args, runs, held, snaps)


def report(args, runs: dict, held: dict, snaps: dict) -> None:
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    meta = report_meta(rounds=args.rounds, prompt=args.prompt, new=args.new, spec=SPEC)
    lines = [f"# MXFP4 experts (GPT-OSS) against bf16 ({meta['date']}, {meta['machine']})", ""]
    lines += [
        f"A random GPT-OSS-shaped model ({SPEC['num_hidden_layers']} layers, hidden "
        f"{SPEC['hidden_size']}, {SPEC['num_local_experts']} experts of "
        f"{SPEC['intermediate_size']}, top {SPEC['num_experts_per_tok']}; 512-token vocabulary), "
        f"{args.prompt}-token prompts, {args.new} new tokens, greedy, steady state, median of "
        f"{args.rounds} interleaved rounds; bf16 activations both.",
        "",
        "| weights | held bytes | batch | total tok/s | decode tok/s | mxfp4 / bf16 (decode) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for name, batch in sorted(runs, key=lambda key: (key[1], key[0])):
        m = med[(name, batch)]
        ratio = m["decode_tok_s"] / med[("bf16", batch)]["decode_tok_s"]
        rows.append({"weights": name, "batch": batch, "held_bytes": held[name], **m})
        lines.append(
            f"| {name} | {held[name] / 1e6:.0f} MB | {batch} | {m['total_tok_s']:.1f} | "
            f"{m['decode_tok_s']:.1f} | {ratio:.2f}x |"
        )
    if snaps:
        lines += ["", "| weights | image bytes | restore weights (s) | restored ready (s) |"]
        lines += ["| --- | --- | --- | --- |"]
        for name, s in snaps.items():
            lines.append(
                f"| {name} | {s['image_bytes'] / 1e6:.1f} MB | {s['restore_weights_s']:.3f} | "
                f"{s['restored_ready_s']:.2f} |"
            )
    save_report(OUT, "mxfp4", meta | {"snapshots": snaps}, rows, lines, _plot(rows))


def _plot(rows: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    batches = sorted({r["batch"] for r in rows})
    for i, name in enumerate(("bf16", "mxfp4")):
        by_batch = {r["batch"]: r["decode_tok_s"] for r in rows if r["weights"] == name}
        tok = [by_batch[b] for b in batches]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(batches))], tok, 0.4, label=name)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tok/s")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
