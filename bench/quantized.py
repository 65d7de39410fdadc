"""Quantized decode: the demo model in bf16, int8 (W8A16 per channel) and int4 (W4A16, groups
of 64 and 32: 128 does not divide the demo's 576), made from the same weights (round to
nearest, compressed-tensors' ``pack-quantized`` layout as llm-compressor writes it), and FP8
quantized at load (``quantization="fp8"``: W8A8 FP8, activations per token), beside llama.cpp
built from source on GGUF files converted from the same checkpoint (bf16, Q8_0, Q4_K_M:
``bench/peers/llama_cpp``). Weight bytes are those the engine holds; their ratio to bf16's is
a memory-bound decode's ceiling (the demo's tied 49152 x 576 embedding / LM head stays bf16,
as the releases keep it).

128-token random prompts, 64 new tokens, greedy, EOS ignored, batch 1 / 8 / 32, every engine
at steady state (a warm-up run first), rounds interleaved. Reports output tokens/s over
prefill + decode (as the issue's table) and the decode alone (warmboot: the time of 64 new
tokens less that of 1, over 63 steps; llama.cpp: its batched-bench's TG rate), the ratios to
warmboot's bf16 and to llama.cpp at the same bits; then each variant's snapshot image bytes
and restore time. Writes ``docs/benchmarks/quantized.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.checkpoints import prompts_for
from bench.common import OUT, pyplot, report_meta, save_report
from bench.decode import run_warmboot
from warmboot import LLM
from warmboot.config import cache_root
from warmboot.models.demo import ensure_default_model

VARIANTS = {  # name -> (bits, group size; None: per channel), None: the bf16 checkpoint, or
    "bf16": None,  # a quantization at load of it
    "int8": (8, None),
    "fp8-at-load": "fp8",
    "int4-g64": (4, 64),
    "int4-g32": (4, 32),
}
PEER_TYPES = {"bf16": "bf16", "int8": "q8_0", "int4-g64": "q4_k_m", "int4-g32": "q4_k_m"}
PEER_TYPES["fp8-at-load"] = "q8_0"


def variant_dir(demo: Path, name: str) -> Path:
    """The demo model quantized as ``name`` (written once under the cache)."""
    if VARIANTS[name] is None or isinstance(VARIANTS[name], str):
        return demo
    bits, group = VARIANTS[name]
    out = cache_root() / "models" / f"{demo.name}-{name}"
    if not (out / "config.json").is_file():
        from tests.quant_checkpoints import write_quantized

        ref = Path(tempfile.mkdtemp(prefix="wb-quant-ref-"))
        try:
            write_quantized(demo, out, ref, "ct-pack", bits=bits, group_size=group, sym=True)
        finally:
            shutil.rmtree(ref, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--no-snapshots", action="store_true")
    args = p.parse_args()
    demo = Path(ensure_default_model())
    names = args.variants.split(",")
    dirs = {n: variant_dir(demo, n) for n in names}
    batches = [int(b) for b in args.batches.split(",")]
    peer = None if args.no_peer else Peer(demo, {PEER_TYPES[n] for n in names})
    engines = {n: _engine(d, max(batches), args.prompt, _at_load(n)) for n, d in dirs.items()}
    sizes = {n: _held_bytes(llm) for n, llm in engines.items()}
    runs: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for batch in batches:
            prompts = prompts_for(batch, args.prompt, 49152, seed=r)
            for name, llm in engines.items():
                runs.setdefault((name, batch), []).append(_warmboot(llm, prompts, args.new))
            if peer is not None:
                for gguf in sorted(peer.files):
                    row = peer.run(gguf, batch, args.prompt, args.new)
                    runs.setdefault((f"llama.cpp {gguf}", batch), []).append(row)
    del engines
    snaps = (
        {} if args.no_snapshots else {n: snapshot_costs(d, _at_load(n)) for n, d in dirs.items()}
    )
    report(args, demo, runs, sizes, snaps, peer)


def _at_load(name: str) -> str | None:
    return VARIANTS[name] if isinstance(VARIANTS[name], str) else None


def _engine(path: Path, batch: int, prompt: int, quantization: str | None) -> LLM:
    """An engine at steady state: its compiled steps ready (the default compiles them in the
    background), a whole batch's prompts prefilled in one step, as ``bench.decode``'s."""
    kw = dict(max_model_len=512, max_num_seqs=batch, max_num_batched_tokens=batch * prompt)
    llm = LLM(str(path), dtype="bfloat16", quantization=quantization, **kw)
    llm.engine.wait_compiled()
    return llm


def _warmboot(llm: LLM, prompts, new: int) -> dict:
    run_warmboot(llm, prompts, new)  # NOTE: warm-up: this batch size's first run
    total, _ = run_warmboot(llm, prompts, new)
    first, _ = run_warmboot(llm, prompts, 1)
    batch = len(prompts)
    return {
        "total_tok_s": batch * new / total,
        "decode_tok_s": batch * (new - 1) / max(total - first, 1e-9),
    }


class Peer:
    """llama.cpp on GGUF files converted from the demo checkpoint (best of 1 and 2 threads)."""

    def __init__(self, demo: Path, types: set[str]):
        from bench.peers import llama_cpp

        self.lib = llama_cpp
        llama_cpp.ensure_build()
        root = cache_root() / "peers" / "gguf"
        root.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, Path] = {}
        for kind in types:
            path = root / f"{demo.name}-{kind}.gguf"
            if not path.is_file():
                if kind == "q4_k_m":
                    base = root / f"{demo.name}-bf16.gguf"
                    if not base.is_file():
                        llama_cpp.convert(demo, base, "bf16")
                    llama_cpp.quantize(base, path, "Q4_K_M")
                else:
                    llama_cpp.convert(demo, path, kind)
            self.files[kind] = path
        self.bits = {k: llama_cpp.gguf_summary(p)["bpw"] for k, p in self.files.items()}

    def run(self, kind: str, batch: int, prompt: int, new: int) -> dict:
        """The faster of 1 and 2 threads by decode rate; ``total_tok_s`` as ours: output
        tokens over prefill + decode time."""
        best: dict = {}
        for threads in (1, 2):
            r = self.lib.decode_tok_s(self.files[kind], batch, prompt, new, threads=threads)
            if r["decode_tok_s"] > best.get("decode_tok_s", 0.0):
                best = {**r, "threads": threads}
        seconds = batch * prompt / best["prefill_tok_s"] + batch * new / best["decode_tok_s"]
        return {"total_tok_s": batch * new / seconds, "decode_tok_s": best["decode_tok_s"]} | {
            "threads": best["threads"]
        }


def _held_bytes(llm: LLM) -> int:
    """The model's parameter bytes (a tied embedding once)."""
    return sum(p.nbytes for p in llm.engine.runner.model.parameters())


def snapshot_costs(path: Path, quantization: str | None = None) -> dict:
    """Image bytes and restore time (median of 3) of a tier-A snapshot of ``path`` (eager
    steps; ``WARMBOOT_START_BY_COST=0`` so each start restores)."""
    store = Path(tempfile.mkdtemp(prefix="wb-quant-snap-"))
    os.environ["WARMBOOT_START_BY_COST"] = "0"
    kw = dict(dtype="bfloat16", snapshot_store=str(store), enforce_eager=True)
    try:
        cold = LLM(str(path), quantization=quantization, **kw)
        cold_s = cold.engine.start_info.ready_s
        del cold
        infos = []
        for _ in range(3):  # NOTE: the median of 3 restores (one alone varied 2x)
            warm = LLM(str(path), quantization=quantization, **kw)
            infos.append(warm.engine.start_info)
            assert infos[-1].path == "restored_image", infos[-1].reason
            del warm
        chunks = sum(f.stat().st_size for f in (store / "chunks").rglob("*") if f.is_file())
        return {
            "image_bytes": chunks,
            "restore_weights_s": statistics.median(i.phase_times["restore_weights"] for i in infos),
            "restored_ready_s": statistics.median(i.ready_s for i in infos),
            "cold_ready_s": cold_s,
        }
    finally:
        shutil.rmtree(store, ignore_errors=True)


def report(args, demo: Path, runs: dict, sizes: dict, snaps: dict, peer: Peer | None) -> None:
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in v[0] if m.endswith("tok_s")}
        for k, v in runs.items()
    }
    names = [n for n in VARIANTS if n in sizes]
    batches = sorted({b for _, b in runs})
    meta = report_meta(model=str(demo.name), rounds=args.rounds, prompt=args.prompt, new=args.new)
    lines = [f"# Quantized decode ({meta['date']}, {meta['machine']})", ""]
    lines += [
        f"Demo model (SmolLM-135M shape), {args.prompt}-token prompts, {args.new} new tokens, "
        f"greedy, steady state, median of {args.rounds} interleaved rounds. tok/s: output "
        "tokens over prefill + decode (total) and over the decode alone (decode).",
        "",
        "| variant | weight bytes | batch | total tok/s | decode tok/s | vs bf16 (decode) "
        "| bytes ceiling | llama.cpp same bits: total / decode | ours / llama.cpp (total, decode) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for name in names:
        for b in batches:
            ours, base = med[(name, b)], med[("bf16", b)] if ("bf16", b) in med else None
            peer_row = med.get((f"llama.cpp {PEER_TYPES[name]}", b)) if peer else None
            row = {"variant": name, "batch": b, **ours, "weight_bytes": sizes[name]}
            row["vs_bf16_decode"] = base and ours["decode_tok_s"] / base["decode_tok_s"]
            row["bytes_ceiling"] = sizes.get("bf16", 0) / sizes[name]
            if peer_row:
                row["peer"] = peer_row
                row["vs_peer_total"] = ours["total_tok_s"] / peer_row["total_tok_s"]
                row["vs_peer_decode"] = ours["decode_tok_s"] / peer_row["decode_tok_s"]
            rows.append(row)
            lines.append(_line(row, PEER_TYPES[name]))
    if snaps:
        lines += [
            "",
            "| variant | image bytes | restore weights (s) | restored ready (s) | cold ready (s) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, s in snaps.items():
            lines.append(
                f"| {name} | {s['image_bytes'] / 1e6:.1f} MB | {s['restore_weights_s']:.3f} | {s['restored_ready_s']:.2f} | {s['cold_ready_s']:.2f} |"
            )
    if peer:
        lines += [
            "",
            "llama.cpp "
            + peer.lib.version()
            + ": bits per weight "
            + ", ".join(f"{k} {v:.2f}" for k, v in peer.bits.items() if v),
        ]
    save_report(OUT, "quantized", meta | {"snapshots": snaps}, rows, lines, _plot(rows, batches))


def _line(row: dict, peer_type: str) -> str:
    peer = row.get("peer")
    peer_cell = (
        f"{peer_type}: {peer['total_tok_s']:.1f} / {peer['decode_tok_s']:.1f}" if peer else "-"
    )
    ratio = f"{row['vs_peer_total']:.2f}x, {row['vs_peer_decode']:.2f}x" if peer else "-"
    vs = f"{row['vs_bf16_decode']:.2f}x" if row["vs_bf16_decode"] else "-"
    return (
        f"| {row['variant']} | {row['weight_bytes'] / 1e6:.0f} MB | {row['batch']} | "
        f"{row['total_tok_s']:.1f} | {row['decode_tok_s']:.1f} | {vs} | "
        f"{row['bytes_ceiling']:.2f}x | {peer_cell} | {ratio} |"
    )


def _plot(rows: list[dict], batches: list[int]):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5))
    axes = axes if len(batches) > 1 else [axes]
    for ax, b in zip(axes, batches, strict=True):
        sel = [r for r in rows if r["batch"] == b]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["decode_tok_s"] for r in sel], 0.4, label="warmboot")
        peer = [r.get("peer", {}).get("decode_tok_s", 0) for r in sel]
        ax.bar([i + 0.2 for i in x], peer, 0.4, label="llama.cpp (same bits)")
        ax.set_xticks(list(x), [r["variant"] for r in sel], rotation=20)
        ax.set_title(f"batch {b}: decode tok/s")
    axes[0].legend()
    return fig


if __name__ == "__main__":
    main()
