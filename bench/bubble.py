"""The GPU bubble on the CPU: sync vs pipelined decode loop, same model, same run.

A small model whose forward takes about as long as the host's per-step work (the regime of a
fast GPU). Both loops use one torch thread for the "device"; the pipelined loop's host work
runs on the other core. Reports output tokens/s and the bubble fraction (device idle / wall
over decode-only steps) per batch size, with and without a JSON-schema constraint, and the
pipelined throughput against the ideal ``sync tok/s / (1 - sync bubble)``.

On the CPU the stand-in device is a Python thread: every torch op it runs needs the GIL,
which the host thread holds while it plans and commits, so the two contend in a way a GPU
does not. A second table (``--standin-ms``) takes that out: a one-layer model whose forward
is padded with a sleep (the GIL released, as while a GPU runs a graph) to a fixed device time
per step, comparable to the host's work: the regime of a small model on a fast GPU. Writes
``docs/benchmarks/bubble.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from bench.checkpoints import random_llama
from bench.common import OUT, machine, pyplot, report_meta, save_figure, write_json, write_page
from bench.timing import interleaved
from warmboot import LLM, SamplingParams
from warmboot.engine.loop import BubbleMeter
from warmboot.sampling_params import StructuredOutputs

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


STANDIN_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=4096,
    tie_word_embeddings=True,
)


def pad_forward(llm: LLM, ms: float) -> None:
    """Make every forward of ``llm`` last at least ``ms`` on the device thread: the rest is
    a sleep, which releases the GIL as a GPU's asynchronous work does."""
    model = llm.engine.runner.model
    forward = model.forward

    def padded(*args, **kw):
        t0 = time.perf_counter()
        out = forward(*args, **kw)
        rest = ms / 1e3 - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return out

    model.forward = padded


def run(llm: LLM, batch: int, prompt_len: int, new_tokens: int, schema: bool) -> dict:
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    eng.loop.meter = BubbleMeter()
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
        "bubble": eng.loop.meter.bubble_fraction,
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
    ap.add_argument(
        "--standin-ms",
        type=float,
        default=2.0,
        help="device ms per step of the stand-in-GPU rows (a padded one-layer model); 0: none",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(args, batches, SHAPE, None)
    if args.standin_ms > 0:
        rows += measure(args, batches, STANDIN_SHAPE, args.standin_ms)
    write_report(args, rows)


def measure(args, batches: list[int], shape: dict, standin_ms: float | None) -> list[dict]:
    model_dir = random_llama("warmboot-bubble-", shape)
    common = dict(
        dtype="float32",
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * args.prompt_len,
        cpu_threads=1,
    )
    loops = {"sync": LLM(str(model_dir), pipelined=False, **common)}
    loops["pipelined"] = LLM(str(model_dir), pipelined=True, **common)
    if standin_ms:
        for llm in loops.values():
            pad_forward(llm, standin_ms)
    rows = []
    for schema in [False] if args.no_schema else [False, True]:
        for batch in batches:
            results = interleaved(
                args.repeats,
                {
                    name: functools.partial(
                        run, llm, batch, args.prompt_len, args.new_tokens, schema
                    )
                    for name, llm in loops.items()
                },
            )
            rows.append(summarise(batch, schema, results) | {"standin_ms": standin_ms})
            r = rows[-1]
            print(
                f"device {standin_ms or 'cpu'} batch {batch:3d} schema={schema!s:5}: "
                f"sync {r['sync_tok_s']:8.1f} tok/s "
                f"bubble {r['sync_bubble']:.1%} | pipelined {r['pipelined_tok_s']:8.1f} tok/s "
                f"bubble {r['pipelined_bubble']:.1%} | speed-up {r['speedup']:.2f}x, "
                f"{r['of_ideal']:.0%} of ideal, same tokens {r['identical_tokens']}",
                flush=True,
            )
    return rows


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
    meta = report_meta(
        machine=machine(),
        model="random Llama, hidden 256, 4 layers, vocab 4096, fp32",
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        torch_threads_for_device=1,
        standin_model="random Llama, hidden 64, 1 layer, vocab 4096, fp32",
    )
    write_json(args.out / "bubble.json", {"meta": meta, "rows": rows})
    head = [
        "| batch | JSON schema | sync tok/s | sync bubble | pipelined tok/s | pipelined bubble "
        "| speed-up | of ideal | same tokens |",
        "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    lines = [
        "# The GPU bubble on the CPU: sync vs pipelined loop",
        "",
        f"{meta['date']} · {meta['machine']} · prompt {args.prompt_len}, {args.new_tokens} new"
        f" tokens, greedy · device = 1 torch thread · median of {args.repeats} interleaved runs"
        " · `python -m bench.bubble`",
        "",
        f"## The CPU as the device: {meta['model']}",
        "",
        *head,
        *[_row(r) for r in rows if not r["standin_ms"]],
    ]
    standin = [r for r in rows if r["standin_ms"]]
    if standin:
        ms = standin[0]["standin_ms"]
        lines += [
            "",
            f"## A stand-in GPU: {meta['standin_model']}, each forward padded to {ms:g} ms",
            "",
            "The padding is a sleep on the device thread, which releases the GIL as a GPU's"
            " asynchronous work does. The rest of the device's work (the real forward, the"
            " sampler, the grammar mask) still takes turns with the host thread for the GIL,"
            " as the host's C calls (xgrammar, numpy) hand it over: a GPU has none of that.",
            "",
            *head,
            *[_row(r) for r in standin],
        ]
    lines += [
        "",
        "ideal = sync tok/s / (1 - sync bubble): the sync loop with its idle time removed.",
    ]
    write_page(args.out / "bubble.md", lines, meta)
    plot(args.out / "bubble.png", meta, rows)
    print(f"wrote {args.out / 'bubble.md'}")


def _row(r: dict) -> str:
    return (
        f"| {r['batch']} | {'yes' if r['schema'] else 'no'} | {r['sync_tok_s']:.1f} | "
        f"{r['sync_bubble']:.1%} | {r['pipelined_tok_s']:.1f} | {r['pipelined_bubble']:.1%} "
        f"| {r['speedup']:.2f}x | {r['of_ideal']:.0%} | "
        f"{'yes' if r['identical_tokens'] else 'no'} |"
    )


def plot(path: Path, meta: dict, rows: list[dict]) -> None:
    plt = pyplot()
    groups = [(f"CPU device: {meta['model']}", [r for r in rows if not r["standin_ms"]])]
    standin = [r for r in rows if r["standin_ms"]]
    if standin:
        ms = standin[0]["standin_ms"]
        groups.append((f"stand-in GPU: {meta['standin_model']}, {ms:g} ms/step", standin))
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 4 * len(groups)), squeeze=False)
    for (title, group), (ax_tok, ax_bubble) in zip(groups, axes, strict=True):
        for schema, style in ((False, "-"), (True, "--")):
            sel = [r for r in group if r["schema"] == schema]
            if not sel:
                continue
            tag = " (JSON schema)" if schema else ""
            xs = [r["batch"] for r in sel]
            for name in ("sync", "pipelined"):
                label = f"{name}{tag}"
                ax_tok.plot(xs, [r[f"{name}_tok_s"] for r in sel], style, marker="o", label=label)
                bubble = [100 * r[f"{name}_bubble"] for r in sel]
                ax_bubble.plot(xs, bubble, style, marker="o", label=label)
        ax_tok.set_ylabel("output tokens/s")
        ax_bubble.set_ylabel("bubble: device idle / wall (%)")
        ax_tok.set_title(title, fontsize=9)
        for ax in (ax_tok, ax_bubble):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.legend(fontsize=7)
    fig.suptitle("Sync vs pipelined decode loop", fontsize=10)
    fig.text(0.01, 0.01, f"{meta['date']} · {meta['machine']}", fontsize=6)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
