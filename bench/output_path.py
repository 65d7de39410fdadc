"""Host cost of streaming outputs per decode step, as outputs grow long.

Every step, each running request's output goes from the engine's output processor to its
consumer: in a worker, through ``output_to_wire``, msgpack and the launcher's
``OutputAccumulator``. A "cumulative" output copies the whole text and token list each
time, O(length) per step; a "delta" output (what the server asks for) carries only the new
token. This drives the real output path with one synthetic token per request per step
(batch 64, random ids through the real tokenizer; no model forward) and reports host ms per
step around output lengths of 1k-8k tokens, for both kinds in the same run. Writes
``docs/benchmarks/output_path.{json,md,png}``.

Run from the repository root: ``python -m bench.output_path``.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from pathlib import Path

import msgpack

from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import interleaved

BATCH = 64
VOCAB = 4096
WINDOW = 64  # steps timed around each output length
KINDS = ("cumulative", "delta")


def make_engine(max_len: int):
    from bench.checkpoints import random_llama
    from warmboot import LLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    shape |= dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB)
    kw = dict(tie_word_embeddings=True, max_position_embeddings=max_len + 16)
    model = random_llama("wb-out-", shape, **kw)
    blocks = (max_len + 16) // 16 + 1
    llm = LLM(str(model), max_model_len=max_len + 16, max_num_seqs=BATCH, num_kv_blocks=blocks)
    return llm.engine


def measure(engine, kind: str, lengths: list[int]) -> dict[int, tuple[float, float]]:
    """{length: (engine ms/step, wire + launcher ms/step)} over WINDOW steps ending there."""
    from warmboot import SamplingParams
    from warmboot.core.types import TokenEvent
    from warmboot.launcher.frames import OutputAccumulator, output_to_wire

    params = SamplingParams(max_tokens=max(lengths) + 1, ignore_eos=True, output_kind=kind)
    accs, children = {}, []
    for i in range(BATCH):
        rid = engine.add_request(f"{kind}-{i}", {"prompt_token_ids": [1, 2, 3]}, params)
        children += engine.outputs.groups[rid].children
        accs[rid] = OutputAccumulator(rid, None, [1, 2, 3], kind)
    rng = random.Random(0)
    timed = {n - WINDOW + 1: n for n in lengths}
    result, start = {}, None
    for step in range(1, max(lengths) + 1):
        if step in timed:
            start, engine_s, wire_s = step, 0.0, 0.0
        t0 = time.perf_counter()
        events = [TokenEvent(c.request_id, [rng.randrange(4, VOCAB)], [None]) for c in children]
        touched, _ = engine.outputs.process(events)
        outs = engine.take_outputs(touched)
        t1 = time.perf_counter()
        for out in outs:
            frame = msgpack.unpackb(msgpack.packb(output_to_wire(out)), strict_map_key=False)
            accs[out.request_id].add(frame)
        t2 = time.perf_counter()
        if start is not None:
            engine_s += t1 - t0
            wire_s += t2 - t1
            if step == timed[start]:
                result[step] = (engine_s / WINDOW * 1e3, wire_s / WINDOW * 1e3)
                start = None
    for c in engine.outputs.groups.copy():
        engine.abort_request(c)
    engine.take_outputs(set())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    engine = make_engine(max(args.lengths))
    runs = {kind: functools.partial(measure, engine, kind, args.lengths) for kind in KINDS}
    samples = interleaved(args.repeats, runs)
    rows = []
    for n in args.lengths:
        row = {"length": n}
        for kind in KINDS:
            runs = sorted(samples[kind], key=lambda r, n=n: sum(r[n]))
            engine_ms, wire_ms = runs[len(runs) // 2][n]
            row[kind] = {"engine_ms": engine_ms, "wire_ms": wire_ms}
        print(row, flush=True)
        rows.append(row)
    write_report(args, rows)


def write_report(args, rows: list[dict]) -> None:
    plt = pyplot()
    meta = report_meta(batch=BATCH, window_steps=WINDOW, repeats=args.repeats)
    lines = [
        "# Streaming output path: host ms per decode step",
        "",
        f"{meta['date']}, {meta['machine']}. `python -m bench.output_path`: batch {BATCH}, one"
        " synthetic token per request per step through the engine's output processor, then"
        " `output_to_wire`, msgpack and the launcher's `OutputAccumulator` (the worker path);"
        f" mean over the {WINDOW} steps up to each output length, median of {args.repeats},"
        " both kinds in the same run. `cumulative` is what every streamed output cost before"
        " `output_kind` existed; the server now asks for `delta`.",
        "",
        "| output tokens | cumulative engine ms | cumulative wire+launcher ms |"
        " delta engine ms | delta wire+launcher ms | cumulative / delta (total) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        c, d = r["cumulative"], r["delta"]
        ratio = (c["engine_ms"] + c["wire_ms"]) / (d["engine_ms"] + d["wire_ms"])
        lines.append(
            f"| {r['length']} | {c['engine_ms']:.2f} | {c['wire_ms']:.2f} | {d['engine_ms']:.2f}"
            f" | {d['wire_ms']:.2f} | {ratio:.2f}x |"
        )
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind in KINDS:
        total = [r[kind]["engine_ms"] + r[kind]["wire_ms"] for r in rows]
        ax.plot([r["length"] for r in rows], total, marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"output tokens per request (batch {BATCH})")
    ax.set_ylabel("host ms per step (engine + wire + launcher)")
    ax.set_title(f"streaming output path, {meta['date']}")
    ax.legend()
    save_report(args.out, "output_path", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
