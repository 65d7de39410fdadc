"""The native weight-only quantized GEMM (``csrc/quant_gemm.cpp``) against the native bf16 GEMM
(``pack_linear`` + ``linear``, ``csrc/gemm.cpp``) at decode sizes.

- Shapes (out x in): the demo model's q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576),
  down (576 x 1536), and a bigger 8192 x 2048.
- Formats: bf16; int8 and int4 in groups of 32 and of 128 (64 where 128 does not divide in),
  fp16 scales, uint8 zeros; FP8 e4m3 (``bits = -8``) in groups of 128 (64), fp16 scales, no
  zeros (int8's bytes less the zeros).
- Each format cycles through copies of the weight (scales and zeros too) that add up to
  ``--mb`` MB or more of bf16, far beyond the caches: every call streams its weights from
  memory. The formats take turns within each repeat (the machine is shared: drift hits all);
  the best pass counts.
- 1 and 8 rows of bf16 x; one thread, and one thread lent a helper thread on the other core
  (``use_helpers``, as the engine runs the native kernels on 2 cores).

GB/s: the bytes a call reads (codes, scales, zeros; bf16 weights) / time; Gw/s: weights a
second; speed-up: bf16's time / the format's.
``python -m bench.quant_gemm [--quick] [--formats int8,fp8] [--fp8-routes N]`` (bf16 always
runs; ``--fp8-routes``: csrc's Fp8Routes bits, 0 the fp16 route alone).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import report_meta
from warmboot.kernels import native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 2048)]


def formats(k: int) -> list[tuple[str, int, int]]:
    """(name, bits, group size); bits 16: the bf16 GEMM."""
    big = 128 if k % 128 == 0 else 64
    return [
        ("bf16", 16, 0),
        ("int8 g32", 8, 32),
        (f"int8 g{big}", 8, big),
        ("int4 g32", 4, 32),
        (f"int4 g{big}", 4, big),
        (f"fp8 g{big}", -8, big),
    ]


def weights(n: int, k: int, bits: int, gs: int, copies: int) -> tuple[list, int]:
    """``copies`` argument tuples for the format's op, and the bytes one call reads."""
    ops, g = torch.ops.warmboot_cpu, torch.Generator().manual_seed(0)
    if bits == 16:
        packed = ops.pack_linear(torch.randn(n, k, generator=g).to(torch.bfloat16))
        return [(packed.clone(), n) for _ in range(copies)], packed.numel() * 2
    if bits == -8:  # FP8 e4m3 codes, no zeros
        codes = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    packed = ops.quant_pack(codes, bits)
    panels = packed.shape[0]
    scales = torch.rand(panels, k // gs, 32, generator=g).half() * 0.01
    zeros = None
    if bits > 0:
        zeros = torch.randint(0, 2**bits, (panels, k // gs, 32), generator=g, dtype=torch.uint8)

    def copy(t):
        return None if t is None else t.clone()

    args = [(packed.clone(), copy(scales), copy(zeros), None, n, bits, gs) for _ in range(copies)]
    zero_bytes = 0 if zeros is None else zeros.numel()
    return args, packed.numel() + scales.numel() * 2 + zero_bytes


def one_pass(x: torch.Tensor, args: list, bits: int) -> float:
    ops = torch.ops.warmboot_cpu
    t0 = time.perf_counter()
    if bits == 16:
        for packed, n in args:
            ops.linear(x, packed, None, n)
    else:
        for a in args:
            ops.quant_linear(x, *a)
    return time.perf_counter() - t0


def shape_rows(
    n: int, k: int, rows: list[int], mb: float, repeats: int, only: list[str]
) -> list[dict]:
    copies = max(2, int(mb * 1e6 / (n * k * 2)))
    fmts = [f for f in formats(k) if f[1] == 16 or not only or f[0].split()[0] in only]
    built = {name: weights(n, k, bits, gs, copies) for name, bits, gs in fmts}
    out = []
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        for helpers in (0, 1):
            native.use_helpers(helpers, [])
            best = dict.fromkeys(built, float("inf"))
            try:
                for _ in range(repeats + 1):  # NOTE: the first pass warms up
                    for name, bits, _ in fmts:
                        best[name] = min(best[name], one_pass(x, built[name][0], bits))
            finally:
                native.use_helpers(0, [])
            for name, _, _ in fmts:
                s = best[name] / copies
                out.append(
                    {
                        "shape": f"{n}x{k}",
                        "rows": m,
                        "threads": 1 + helpers,
                        "format": name,
                        "us": s * 1e6,
                        "gb_s": built[name][1] / s / 1e9,
                        "gw_s": n * k / s / 1e9,
                        "speedup": best["bf16"] / best[name],
                    }
                )
    return out


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| shape | rows | threads | format | us | GB/s | Gw/s | vs bf16 |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['threads']} | {r['format']} | {r['us']:.1f} "
            f"| {r['gb_s']:.1f} | {r['gw_s']:.1f} | {r['speedup']:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 64 MB of copies")
    ap.add_argument("--mb", type=float, default=256.0, help="bf16 MB of weight copies a shape")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--isa", help="run a lower instruction set (avx512, avx2, portable)")
    ap.add_argument("--formats", default="", help="only these, e.g. int8,fp8 (bf16 always)")
    ap.add_argument("--fp8-routes", type=int, help="FP8's routes (1 subnormal, 2 table)")
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    if args.isa:
        torch.ops.warmboot_cpu.use_isa(args.isa)
    if args.fp8_routes is not None:
        torch.ops.warmboot_cpu.quant_fp8_routes(args.fp8_routes)
    torch.set_num_threads(1)  # NOTE: the helpers serve only a caller on one torch thread
    mb, repeats = (64.0, 2) if args.quick else (args.mb, 5)
    routes = torch.ops.warmboot_cpu.quant_fp8_routes(0)
    torch.ops.warmboot_cpu.quant_fp8_routes(routes)
    meta = report_meta(isa=native.isa(), fp8_routes=routes, mb=mb, repeats=repeats)
    print(meta, flush=True)
    rows = []
    only = [f for f in args.formats.split(",") if f]
    for n, k in SHAPES:
        new = shape_rows(n, k, [1, 8], mb, repeats, only)
        rows += new
        print("\n".join(table(new)[2:]), flush=True)
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta | {"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
