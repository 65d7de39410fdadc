"""Sparse indexed attention's decode step against the dense latent attention it replaces, and
Llama 4's chunked local attention against full attention:
one layer of DeepSeek-V3.2's shape (the absorbed query: 576-wide latent entries, one KV head;
16 query heads instead of 128, a 2-core CPU; the indexer's 64 heads of 128, ``index_topk``
2048), bf16, at batch 1 and 8 and contexts of 1k to 32k tokens.

- ``dense``: the torch backend's decode over every cached position (the native paged kernel,
  as DeepSeek-V3 runs).
- ``sparse``: ``kernels.sparse_attention.indexed``: the indexer's keys scored, the top 2048
  picked, attention over those alone.

- ``chunked``: a Llama 4 layer's decode (40 query heads, 8 KV heads of 128, bf16) with
  ``attention_chunk_size`` 8192 against the same layer attending to every position (the
  native paged decode kernel both).

Time per step (median of repeats, after a warm-up; the lower of two interleaved rounds), and
the ratios. Writes
``docs/benchmarks/sparse_attention.{json,md,png}``. ``python bench/sparse_attention.py
[--quick]``.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import median_of
from warmboot.kernels.backend import AttentionMetadata, AttentionSpec
from warmboot.kernels.sparse_attention import indexed
from warmboot.kernels.step_ops import StepContext
from warmboot.kernels.torch_attention import TorchAttentionBackend

HEADS, ENTRY, INDEX_HEADS, INDEX_DIM, TOPK, BLOCK = 16, 576, 64, 128, 2048, 16
DTYPE = torch.bfloat16


def _step(batch: int, context: int) -> tuple[StepContext, tuple]:
    """A decode step of ``batch`` sequences of ``context`` tokens (their last one new)."""
    blocks = context // BLOCK
    pages = torch.randn(batch * blocks + 1, BLOCK, 1, ENTRY, dtype=DTYPE)
    keys = torch.randn(batch * blocks + 1, BLOCK, INDEX_DIM, dtype=DTYPE)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), context)
    slots = tables[:, -1] * BLOCK + BLOCK - 1
    meta = AttentionMetadata(slots, batch, tables, lens, [], BLOCK)
    spec = AttentionSpec(scale=(192**-0.5))
    ctx = StepContext(TorchAttentionBackend(), [(pages, pages, keys)], meta, [spec])
    q = torch.randn(batch, HEADS, ENTRY, dtype=DTYPE)
    entry = torch.randn(batch, 1, ENTRY, dtype=DTYPE)
    iq = torch.randn(batch, INDEX_HEADS, INDEX_DIM, dtype=DTYPE)
    ik = torch.randn(batch, INDEX_DIM, dtype=DTYPE)
    iw = torch.randn(batch, INDEX_HEADS) * INDEX_HEADS**-0.5
    return ctx, (q, entry, entry, iq, ik, iw)


def measure(batch: int, context: int, repeats: int) -> dict:
    ctx, (q, k, v, iq, ik, iw) = _step(batch, context)
    dense = median_of(lambda: ctx.attend(0, q, k, v), repeats)
    how = (TOPK, 0, 0, False)
    sparse = median_of(lambda: indexed(ctx, 0, q, k, v, iq, ik, iw, how), repeats)
    return dict(batch=batch, context=context, dense_ms=dense * 1e3, sparse_ms=sparse * 1e3)


def measure_chunk(batch: int, context: int, repeats: int, chunk: int = 8192) -> dict:
    blocks = context // BLOCK
    shape = (batch * blocks + 1, BLOCK, 8, 128)
    k_pages, v_pages = torch.randn(shape, dtype=DTYPE), torch.randn(shape, dtype=DTYPE)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    meta = AttentionMetadata(
        tables[:, -1] * BLOCK + BLOCK - 1, batch, tables, torch.full((batch,), context), [], BLOCK
    )
    q = torch.randn(batch, 40, 128, dtype=DTYPE)
    k = v = torch.randn(batch, 8, 128, dtype=DTYPE)
    times = {}
    for name, spec in (
        ("full", AttentionSpec(0.088)),
        ("chunked", AttentionSpec(0.088, chunk=chunk)),
    ):
        ctx = StepContext(TorchAttentionBackend(), [(k_pages, v_pages)], meta, [spec])
        times[name] = median_of(lambda ctx=ctx: ctx.attend(0, q, k, v), repeats) * 1e3
    return dict(batch=batch, context=context, full_ms=times["full"], chunked_ms=times["chunked"])


ROUNDS = 2


def _rounds(fn, configs, repeats: int) -> list[dict]:
    """``fn`` over ``configs``, ``ROUNDS`` rounds interleaved (each config once a round, both
    variants back to back): each time the lower of the rounds' medians."""
    runs = [[fn(b, c, repeats) for b, c in configs] for _ in range(ROUNDS)]
    rows = []
    for same in zip(*runs, strict=True):
        times = {k: min(r[k] for r in same) for k in same[0] if k.endswith("_ms")}
        rows.append(same[0] | times)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    contexts = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    repeats = 3 if args.quick else 9
    configs = [(b, c) for b in (1, 8) for c in contexts]
    rows = _rounds(measure, configs, repeats)
    chunk_rows = _rounds(measure_chunk, [(b, c) for b in (1, 8) for c in contexts[-2:]], repeats)
    meta = report_meta(threads=torch.get_num_threads(), heads=HEADS, topk=TOPK)
    lines = [
        "# Sparse indexed attention: one decode step of one layer",
        "",
        f"{meta['date']}, {meta['machine']}, {meta['threads']} threads; DeepSeek-V3.2's layer"
        f" shape with {HEADS} query heads, `index_topk` {TOPK}, bf16; steady state, the lower"
        f" of {ROUNDS} interleaved rounds' medians (`bench/sparse_attention.py`).",
        "",
        "| batch | context | dense ms | sparse ms | sparse / dense |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r["sparse_ms"] / r["dense_ms"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['dense_ms']:.2f} | {r['sparse_ms']:.2f}"
            f" | {ratio:.2f}x |"
        )
    lines += [
        "",
        "Llama 4 chunked local attention (chunks of 8192), one decode step of one layer:",
        "",
        "| batch | context | full ms | chunked ms | chunked / full |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in chunk_rows:
        ratio = r["chunked_ms"] / r["full_ms"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['full_ms']:.2f} | {r['chunked_ms']:.2f}"
            f" | {ratio:.2f}x |"
        )
    lines += [
        "",
        "The sparse step reads only the chosen 2048 positions' latent entries (the native paged",
        "decode kernel over one-slot blocks), but scores every past position first: 64 indexer",
        "heads of 128 in float32 (as transformers), which costs about what dense attention over",
        "576-wide entries with 16 heads does, so on the CPU it only breaks even from about 16k",
        "tokens. The real model's 128 query heads make its dense attention 8x this one's, the",
        "indexer the same; a fused indexer kernel (one pass over the paged keys, bf16 or",
        "int8 dot products) is what would make it pay earlier.",
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in (1, 8):
        sel = [r for r in rows if r["batch"] == b]
        xs = [r["context"] for r in sel]
        ax.plot(xs, [r["dense_ms"] for r in sel], "o-", label=f"dense, batch {b}")
        ax.plot(xs, [r["sparse_ms"] for r in sel], "s--", label=f"sparse, batch {b}")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per step")
    ax.legend()
    save_report(OUT, "sparse_attention", meta, rows + chunk_rows, lines, fig)


if __name__ == "__main__":
    main()
