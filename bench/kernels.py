"""The decode hot path's kernels against the machine's memory bandwidth: the native bf16
GEMM and oneDNN's, the native paged decode attention and the torch path it replaces.

- Bandwidth: ``torch.sum`` over 1 GiB (a pure read), one thread and every core.
- GEMM: a whole decode step's weights at the demo model's shapes (30 layers of q/k/v, o,
  gate/up and down, then the LM head: 269 MB, far beyond the caches), at 1 to 64 rows, one
  thread, and one thread with a helper thread on the other core (``native+helper``, as the
  engine runs them on 2 cores); GB/s = weight bytes / time (the floor: the read bandwidth).
- Attention: one decode step's 30 layers (9 query heads, 3 KV heads, head dim 64, bf16) at
  batch 1 / 8 / 32 and context 256 / 1024, one thread and with the helper; GB/s = K/V
  bytes read / time.
- Prefill attention: one layer's chunk of n query tokens over a context of ctx (n = ctx: no
  cached context), bf16, the native op against SDPA as the backend runs it (K/V gathered
  where there is cached context), and the flash kernel on AMX tiles (``causal_prefill`` for a
  fresh chunk, ``paged_prefill`` over cached context; one thread and lent the helper); the
  backend's pick named.
- Soft-capped prefill attention (Gemma 2 2B's shape, ``CAPPED_SHAPE``): the per-sequence
  native kernel against the flash kernel, one thread.

Writes ``docs/benchmarks/kernels.{json,md,png}``. ``python bench/kernels.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from functools import partial
from pathlib import Path

import torch

from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import best_of
from warmboot.kernels import native
from warmboot.kernels.step_ops import pack_weight, packed_gemm

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def bandwidth(threads: int, repeats: int) -> float:
    """GB/s of a 1 GiB read (``sum``) on ``threads`` torch threads."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    torch.set_num_threads(threads)
    try:
        return x.numel() * 4 / best_of(lambda: x.sum(), repeats) / 1e9
    finally:
        torch.set_num_threads(1)


@contextlib.contextmanager
def lent(kernel: str):
    """``native+helper``: the native kernel with one helper thread beside the caller."""
    if kernel.endswith("+helper"):
        native.use_helpers(1, [])
    try:
        yield
    finally:
        if kernel.endswith("+helper"):
            native.use_helpers(0, [])


def gemm_rows(rows: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for n, k in shapes]
    total = sum(w.numel() * 2 for w in weights) / 1e9
    kernels = ["onednn"] + (["native", "native+helper"] if native.library() else [])
    packed = {k: [pack_weight(w, k.split("+")[0]) for w in weights] for k in kernels}
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in (HIDDEN, INTER)}
        for kernel in kernels:

            def step(kernel=kernel, xs=xs) -> None:
                for (n, k), w in zip(shapes, packed[kernel], strict=True):
                    packed_gemm(xs[k], w, None, n)

            with lent(kernel):
                s = best_of(step, repeats)
            out.append({"kernel": kernel, "rows": m, "ms": s * 1e3, "gb_s": total / s})
            print(out[-1], flush=True)
    return out


def attention_rows(batches: list[int], contexts: list[int], repeats: int) -> list[dict]:
    from warmboot.kernels.backend import AttentionMetadata
    from warmboot.kernels.native.attention import paged_decode
    from warmboot.kernels.torch_attention import TorchAttentionBackend

    out = []
    torch_backend = TorchAttentionBackend(native_kernels=False)
    for ctx in contexts:
        for b in batches:
            per_seq = -(-ctx // BLOCK)
            blocks = b * per_seq + 1
            shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
            caches = [
                (torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
                for _ in range(LAYERS)
            ]
            tables = torch.randperm(blocks - 1)[: b * per_seq].view(b, per_seq) + 1
            lens = torch.full((b,), ctx, dtype=torch.int64)
            q = torch.randn(b, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(b, dtype=torch.int64),
                num_decode_tokens=b,
                decode_block_tables=tables,
                decode_seq_lens=lens,
                prefills=[],
                block_size=BLOCK,
            )
            read = LAYERS * b * ctx * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9

            def run_native(caches=caches, q=q, tables=tables, lens=lens) -> None:
                for k, v in caches:
                    paged_decode(q, k, v, tables, lens, HEAD_DIM**-0.5, None, None, None)

            def run_torch(caches=caches, q=q, meta=meta) -> None:
                for k, v in caches:
                    meta.cache.clear()
                    torch_backend._decode(q, k, v, meta, HEAD_DIM**-0.5, None, None, None)

            for name, fn in (
                ("native", run_native),
                ("native+helper", run_native),
                ("torch", run_torch),
            ):
                with lent(name):
                    s = best_of(fn, repeats)
                row = {"kernel": name, "batch": b, "context": ctx, "ms": s * 1e3}
                out.append(row | {"gb_s": read / s})
                print(out[-1], flush=True)
    return out


PREFILLS = [(16, 16), (64, 64), (128, 128), (512, 512), (2048, 2048), (128, 1024), (512, 2048)]


def prefill_rows(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    from warmboot.kernels.backend import PrefillSeq
    from warmboot.kernels.native import attention
    from warmboot.kernels.torch_attention import TorchAttentionBackend

    out = []
    sdpa, both = TorchAttentionBackend(native_kernels=False), TorchAttentionBackend(True)
    for n, ctx in cases:
        blocks = -(-ctx // BLOCK)
        k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in "kv")
        table = torch.randperm(blocks)
        q = torch.randn(n, HEADS, HEAD_DIM).to(torch.bfloat16)
        new = [c[table].view(-1, KV_HEADS, HEAD_DIM)[ctx - n : ctx] for c in (k, v)]
        seq = PrefillSeq(0, n, ctx, table)
        native_s = best_of(partial(attention.paged_extend, q, k, v, table, ctx, 0.125), repeats)
        sdpa_s = best_of(
            partial(sdpa._prefill, q, *new, k, v, seq, 0.125, None, None, None), repeats
        )
        pick = "native" if both._native_prefill(q, None, None) else "SDPA"
        row = {"n": n, "context": ctx, "native_ms": native_s * 1e3, "sdpa_ms": sdpa_s * 1e3}
        if attention.flash_prefill(q):
            row |= flash_ms(q, k, v, seq, new, repeats)
            pick = "flash"
        out.append(row | {"backend_runs": pick})
        print(out[-1], flush=True)
    return out


CAPPED = [(128, 128), (512, 512), (2048, 2048), (512, 2048)]
CAPPED_SHAPE = (8, 4, 256, 50.0)
"""Soft-capped chunks: Gemma 2 2B's attention (query heads, KV heads, head_dim, softcap)."""


def capped_rows(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Soft-capped prefill chunks, one thread: the per-sequence native kernel
    (``paged_extend``, which took them before the flash kernel took the cap) and the flash
    kernel as the backend runs it."""
    from warmboot.kernels.backend import PrefillSeq
    from warmboot.kernels.native import attention

    hq, hkv, d, cap = CAPPED_SHAPE
    scale, out = d**-0.5, []
    for n, ctx in cases:
        blocks = -(-ctx // BLOCK)
        k, v = (torch.randn(blocks, BLOCK, hkv, d).to(torch.bfloat16) for _ in "kv")
        table, q = torch.randperm(blocks), torch.randn(n, hq, d).to(torch.bfloat16)
        native_s = best_of(
            partial(attention.paged_extend, q, k, v, table, ctx, scale, None, cap), repeats
        )
        row = {"n": n, "context": ctx, "native_ms": native_s * 1e3}
        if attention.flash_prefill(q):
            new = [c[table].view(-1, hkv, d)[ctx - n : ctx] for c in (k, v)]
            seq = PrefillSeq(0, n, ctx, table)
            row |= flash_ms(q, k, v, seq, new, repeats, scale, cap, lent_too=False)
        out.append(row)
        print(out[-1], flush=True)
    return out


def flash_ms(q, k, v, seq, new, repeats: int, scale=0.125, cap=None, lent_too=True) -> dict:
    """The chunk through the flash kernel on AMX tiles, as the backend runs it (a fresh one
    through ``causal_prefill`` on its own K/V rows, one over cached context through
    ``paged_prefill`` on the blocks; scores soft-capped where ``cap``): one thread, and
    lent the helper (``lent_too``)."""
    from warmboot.kernels.native import attention

    out, opts = torch.empty_like(q), (scale, None, None, cap)
    if seq.context_len == seq.query_len:
        rows = [t.contiguous() for t in new]
        run = partial(attention.causal_prefill, q, *rows, out, [0], [seq.query_len], *opts)
    else:
        run = partial(attention.paged_prefill, q, k, v, out, [seq], *opts)
    row = {"flash_ms": best_of(run, repeats) * 1e3}
    if lent_too:
        with lent("flash+helper"):
            row["flash_helper_ms"] = best_of(run, repeats) * 1e3
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke run)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    torch.set_num_threads(1)
    repeats = 2 if args.quick else 5
    rows = [1, 8] if args.quick else [1, 4, 8, 16, 32, 64]
    bw = {"1": bandwidth(1, repeats), "all": bandwidth(os.cpu_count() or 1, repeats)}
    gemm = gemm_rows(rows, repeats)
    attn, prefill, capped = [], [], []
    if native.library():
        batches, contexts = ([1, 8], [256]) if args.quick else ([1, 8, 32], [256, 1024])
        attn = attention_rows(batches, contexts, repeats)
        prefill = prefill_rows(PREFILLS[:3] if args.quick else PREFILLS, repeats)
        capped = capped_rows(CAPPED[:1] if args.quick else CAPPED, repeats)
    isa = f"{native.isa()} + AMX tiles from 4 rows" if native.amx() else native.isa()
    meta = report_meta(isa=isa, bandwidth_gb_s=bw, torch=torch.__version__)
    write(args.out, meta, gemm, attn, prefill, capped)


def write(
    out: Path,
    meta: dict,
    gemm: list[dict],
    attn: list[dict],
    prefill: list[dict],
    capped: list[dict],
) -> None:
    bw1, bwn = meta["bandwidth_gb_s"]["1"], meta["bandwidth_gb_s"]["all"]
    lines = [
        "# Decode kernels against the machine's memory bandwidth",
        "",
        f"{meta['date']} · {meta['machine']} · torch {meta['torch']} · native kernels: "
        f"{meta['isa']} · one compute thread (+ one helper thread where named) · "
        "`python bench/kernels.py`",
        "",
        f"Read bandwidth (`sum` over 1 GiB): one core **{bw1:.1f} GB/s**, all cores "
        f"**{bwn:.1f} GB/s**.",
        "",
        "## bf16 GEMM: a decode step's weights (demo model, 269 MB)",
        "",
        "| rows | native ms | native GB/s | oneDNN ms | oneDNN GB/s | native / oneDNN | "
        "native / one core's bandwidth | native+helper ms | GB/s | / all cores' bandwidth |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(r["kernel"], r["rows"]): r for r in gemm}
    for m in sorted({r["rows"] for r in gemm}):
        n, o, h = by.get(("native", m)), by[("onednn", m)], by.get(("native+helper", m))
        lines.append(
            f"| {m} | {_f(n, 'ms')} | {_f(n, 'gb_s')} | {o['ms']:.1f} | {o['gb_s']:.1f} | "
            f"{(o['ms'] / n['ms']) if n else float('nan'):.2f}x | "
            f"{(n['gb_s'] / bw1 * 100) if n else float('nan'):.0f}% | {_f(h, 'ms')} | "
            f"{_f(h, 'gb_s')} | {(h['gb_s'] / bwn * 100) if h else float('nan'):.0f}% |"
        )
    if attn:
        lines += [
            "",
            "## Paged decode attention: a step's 30 layers (9 q / 3 KV heads, dim 64, bf16)",
            "",
            "| context | batch | native ms | native GB/s | native+helper ms | GB/s | "
            "torch (gather + SDPA) ms | native / torch |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        ab = {(r["kernel"], r["batch"], r["context"]): r for r in attn}
        for ctx, b in sorted({(r["context"], r["batch"]) for r in attn}):
            n, t = ab[("native", b, ctx)], ab[("torch", b, ctx)]
            h = ab[("native+helper", b, ctx)]
            lines.append(
                f"| {ctx} | {b} | {n['ms']:.2f} | {n['gb_s']:.1f} | {h['ms']:.2f} | "
                f"{h['gb_s']:.1f} | {t['ms']:.2f} | {t['ms'] / n['ms']:.2f}x |"
            )
    if prefill:
        lines += [
            "",
            "## Prefill attention: one layer's chunk (9 q / 3 KV heads, dim 64, bf16)",
            "",
            "| query tokens | context | native ms | SDPA ms | native / SDPA | flash ms | "
            "flash / SDPA | flash+helper ms | the backend runs |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
        ]
        for r in prefill:
            flash = (
                f"{r['flash_ms']:.3f} | {r['flash_ms'] / r['sdpa_ms']:.2f}x | "
                f"{r['flash_helper_ms']:.3f}"
                if "flash_ms" in r
                else "- | - | -"
            )
            lines.append(
                f"| {r['n']} | {r['context']} | {r['native_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                f"{r['native_ms'] / r['sdpa_ms']:.2f}x | {flash} | {r['backend_runs']} |"
            )
    lines += _capped_lines(capped)
    data = {
        "gemm": gemm,
        "attention": attn,
        "prefill_attention": prefill,
        "capped_prefill_attention": capped,
    }
    save_report(out, "kernels", meta, data, lines, _plot(gemm, attn, bw1, bwn))


def _plot(gemm: list[dict], attn: list[dict], bw1: float, bwn: float):
    plt = pyplot()
    fig, ax = plt.subplots(1, 2 if attn else 1, figsize=(11 if attn else 6, 4), squeeze=False)
    for kernel in ("native", "native+helper", "onednn"):
        pts = sorted((r["rows"], r["gb_s"]) for r in gemm if r["kernel"] == kernel)
        if pts:
            ax[0][0].plot(*zip(*pts, strict=True), marker="o", label=kernel)
    ax[0][0].axhline(bw1, ls="--", c="gray", label="one core's read bandwidth")
    ax[0][0].axhline(bwn, ls=":", c="gray", label="all cores' read bandwidth")
    ax[0][0].set(xscale="log", xlabel="rows", ylabel="GB/s (weights)", title="bf16 GEMM")
    ax[0][0].legend()
    if attn:
        for kernel in ("native", "native+helper", "torch"):
            for ctx in sorted({r["context"] for r in attn}):
                pts = sorted(
                    (r["batch"], r["ms"])
                    for r in attn
                    if r["kernel"] == kernel and r["context"] == ctx
                )
                ax[0][1].plot(*zip(*pts, strict=True), marker="o", label=f"{kernel}, ctx {ctx}")
        ax[0][1].set(
            xscale="log",
            yscale="log",
            xlabel="batch",
            ylabel="ms per step (30 layers)",
            title="paged decode attention",
        )
        ax[0][1].legend(fontsize=8)
    return fig


def _capped_lines(capped: list[dict]) -> list[str]:
    if not capped:
        return []
    hq, hkv, d, cap = CAPPED_SHAPE
    lines = [
        "",
        f"## Soft-capped prefill attention: one layer's chunk (Gemma 2 2B's: {hq} q / {hkv} KV "
        f"heads, dim {d}, softcap {cap:g}, bf16)",
        "",
        "| query tokens | context | native (per sequence) ms | flash ms | flash / native |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in capped:
        f = r.get("flash_ms")
        flash = f"{f:.3f} | {f / r['native_ms']:.2f}x" if f else "- | -"
        lines.append(f"| {r['n']} | {r['context']} | {r['native_ms']:.3f} | {flash} |")
    return lines


def _f(row: dict | None, key: str) -> str:
    return "n/a" if row is None else f"{row[key]:.1f}"


if __name__ == "__main__":
    main()
