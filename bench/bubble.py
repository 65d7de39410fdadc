"""The GPU bubble on the CPU: sync vs pipelined decode loop, same model, same run.

A small model whose forward takes about as long as the host's per-step work (the regime of a
fast GPU). Both loops use one torch thread for the "device"; the pipelined loop's host work
runs on the other core. Reports output tokens/s and the bubble fraction (device idle / wall
over decode-only steps) per batch size, with and without a JSON-schema constraint, and the
pipelined throughput against the ideal ``sync tok/s / (1 - sync bubble)``. Writes
``docs/benchmarks/bubble.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode import machine
from warmboot import LLM, SamplingParams
from warmboot.engine.loop import BubbleMeter
from warmboot.models.demo import write_random_llama
from warmboot.sampling_params import StructuredOutputs
from warmboot.tokenizer.train import train_tokenizer

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
}
SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    tie_word_embeddings=True,
)


def run(llm: LLM, batch: int, prompt_len: int, new_tokens: int, schema: bool) -> dict:
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    eng.meter = BubbleMeter()
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, 4096, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=new_tokens,
        ignore_eos=not schema,
        structured_outputs=StructuredOutputs(json=SCHEMA) if schema else None,
    )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if schema:
        for o in outs:  # the constraint must hold, or the figure is meaningless
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)
    return {
        "tok_s": tokens / wall,
        "bubble": eng.meter.bubble_fraction,
        "tokens": tokens,
        "tokens_out": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-schema", action="store_true", help="skip the JSON-schema rows")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = Path(tempfile.mkdtemp(prefix="warmboot-bubble-")) / "model"
    write_random_llama(model_dir, **SHAPE, seed=0, dtype="float32")
    train_tokenizer(model_dir, SHAPE["vocab_size"])
    common = dict(
        dtype="float32",
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * args.prompt_len,
        cpu_threads=1,
    )
    loops = {"sync": LLM(str(model_dir), pipelined=False, **common)}
    loops["pipelined"] = LLM(str(model_dir), pipelined=True, **common)
    rows = []
    for schema in [False] if args.no_schema else [False, True]:
        for batch in batches:
            results: dict[str, list[dict]] = {"sync": [], "pipelined": []}
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                for name, llm in loops.items():
                    results[name].append(run(llm, batch, args.prompt_len, args.new_tokens, schema))
            rows.append(summarise(batch, schema, results))
            r = rows[-1]
            print(
                f"batch {batch:3d} schema={schema!s:5}: sync {r['sync_tok_s']:8.1f} tok/s "
                f"bubble {r['sync_bubble']:.1%} | pipelined {r['pipelined_tok_s']:8.1f} tok/s "
                f"bubble {r['pipelined_bubble']:.1%} | speed-up {r['speedup']:.2f}x, "
                f"{r['of_ideal']:.0%} of ideal, same tokens {r['identical_tokens']}",
                flush=True,
            )
    write_report(args, rows)


def summarise(batch: int, schema: bool, results: dict[str, list[dict]]) -> dict:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    row = {"batch": batch, "schema": schema}
    for name in results:
        row[f"{name}_tok_s"] = med(name, "tok_s")
        row[f"{name}_bubble"] = med(name, "bubble")
    row["speedup"] = row["pipelined_tok_s"] / row["sync_tok_s"]
    ideal = row["sync_tok_s"] / (1 - row["sync_bubble"])
    row["of_ideal"] = row["pipelined_tok_s"] / ideal
    row["identical_tokens"] = all(
        a["tokens_out"] == b["tokens_out"]
        for a, b in zip(results["sync"], results["pipelined"], strict=True)
    )
    return row


def write_report(args, rows: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "model": "random Llama, hidden 256, 4 layers, vocab 4096, fp32",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch_threads_for_device": 1,
    }
    (args.out / "bubble.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# The GPU bubble on the CPU: sync vs pipelined loop",
        "",
        f"{meta['date']} · {meta['machine']} · {meta['model']} · prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy · device = 1 torch thread · median of "
        f"{args.repeats} interleaved runs · `python -m bench.bubble`",
        "",
        "| batch | JSON schema | sync tok/s | sync bubble | pipelined tok/s | pipelined bubble "
        "| speed-up | of ideal | same tokens |",
        "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {'yes' if r['schema'] else 'no'} | {r['sync_tok_s']:.1f} | "
            f"{r['sync_bubble']:.1%} | {r['pipelined_tok_s']:.1f} | {r['pipelined_bubble']:.1%} "
            f"| {r['speedup']:.2f}x | {r['of_ideal']:.0%} | "
            f"{'yes' if r['identical_tokens'] else 'no'} |"
        )
    lines += [
        "",
        "ideal = sync tok/s / (1 - sync bubble): the sync loop with its idle time removed.",
    ]
    (args.out / "bubble.md").write_text("\n".join(lines) + "\n")
    plot(args.out / "bubble.png", meta, rows)
    print(f"wrote {args.out / 'bubble.md'}")


def plot(path: Path, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for schema, style in ((False, "-"), (True, "--")):
        sel = [r for r in rows if r["schema"] == schema]
        if not sel:
            continue
        tag = " (JSON schema)" if schema else ""
        xs = [r["batch"] for r in sel]
        for name in ("sync", "pipelined"):
            axes[0].plot(
                xs, [r[f"{name}_tok_s"] for r in sel], style, marker="o", label=f"{name}{tag}"
            )
            axes[1].plot(
                xs,
                [100 * r[f"{name}_bubble"] for r in sel],
                style,
                marker="o",
                label=f"{name}{tag}",
            )
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("bubble: device idle / wall (%)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.legend(fontsize=7)
    fig.suptitle(f"Sync vs pipelined decode loop, {meta['model']}", fontsize=10)
    fig.text(0.01, 0.01, f"{meta['date']} · {meta['machine']}", fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
