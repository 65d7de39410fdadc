"""The quantized linear's Triton kernel on a GPU (``kernels/triton_quant.py``): correctness
against the dequantized weight and torch's GEMM, then its time at decode row counts beside
the dense bf16 GEMM of the same shape (weight bytes read per call / time = GB/s).

    python -m bench.gpu_quant --out gpu_quant.json             # CUDA (bench/gpu_run.sh)
    python -m bench.gpu_quant --cpu --smoke --out x.json        # Triton's interpreter, tiny

Formats: int8 per channel, int4 groups of 128 (asymmetric), FP8 per channel, FP4 (MXFP4)
groups of 32 with power-of-two scales. Shapes: Llama-3-8B's q/o (4096 x 4096) and down
(4096 x 14336) projections.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.common import git_tree

FORMATS = {"int8": (8, None, False), "int4-g128": (4, 128, True), "fp8": (-8, None, False)}
FORMATS["fp4-g32"] = (-4, 32, False)
SHAPES = [(4096, 4096), (4096, 14336)]
ROWS = [1, 64]  # NOTE: a compile per tile config: the 45 s box


def weights(n: int, k: int, fmt: str, device: str, gen):
    """Random codes, scales and zeros of ``fmt`` in the panel layout."""
    import torch

    from warmboot.kernels import quant

    bits, group, asym = FORMATS[fmt]
    group = group or k
    hi = 256 if abs(bits) == 8 else 16
    codes = torch.randint(0, hi, (n, k), generator=gen, dtype=torch.uint8)
    if bits == quant.FP8:
        codes[(codes & 0x7F) == 0x7F] = 0  # NOTE: no NaN codes
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    if bits == quant.FP4:
        scales = torch.exp2(torch.randint(-8, -2, scales.shape, generator=gen).float())
    scales = scales.to(torch.bfloat16)
    zeros = torch.randint(0, hi, scales.shape, generator=gen, dtype=torch.uint8) if asym else None
    packed = quant.pack_codes(codes, bits).to(device)
    pz = None if zeros is None else quant.pack_groups(zeros).to(device)
    return packed, quant.pack_groups(scales).to(device), pz, bits, group


def check(out: dict, args) -> None:
    import torch
    from torch.nn import functional as F

    from warmboot.kernels import quant
    from warmboot.kernels.triton_quant import triton_quant_linear

    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 256)] if args.smoke else SHAPES
    for (n, k), fmt in [(s, f) for s in shapes for f in FORMATS]:
        packed, scales, zeros, bits, group = weights(n, k, fmt, args.device, gen)
        for m in [1, 5] if args.smoke else ROWS:
            x = torch.randn(m, k, generator=gen).to(args.device, torch.bfloat16)
            y = triton_quant_linear(x, packed, scales, zeros, None, n, bits, group)
            w = quant.dequantize(packed, scales, zeros, bits, group, n, torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            out["correctness"].append(dict(n=n, k=k, fmt=fmt, rows=m, rel_err=err))


def timing(out: dict, args) -> None:
    import torch
    from torch.nn import functional as F

    from warmboot.kernels.triton_quant import triton_quant_linear

    gen = torch.Generator().manual_seed(1)
    shapes = [(96, 256)] if args.smoke else SHAPES
    for n, k in shapes:
        dense = torch.randn(n, k, generator=gen).to(args.device, torch.bfloat16)
        for m in [1] if args.smoke else ROWS:
            x = torch.randn(m, k, generator=gen).to(args.device, torch.bfloat16)
            row = dict(n=n, k=k, rows=m, bf16_ms=_ms(lambda: F.linear(x, dense), args))  # noqa: B023
            row["bf16_GBps"] = dense.nbytes / row["bf16_ms"] / 1e6
            for fmt in FORMATS:
                packed, scales, zeros, bits, group = weights(n, k, fmt, args.device, gen)
                run = lambda: triton_quant_linear(x, packed, scales, zeros, None, n, bits, group)  # noqa: B023, E731
                row[f"{fmt}_ms"] = ms = _ms(run, args)
                nbytes = packed.nbytes + scales.nbytes + (0 if zeros is None else zeros.nbytes)
                row[f"{fmt}_GBps"] = nbytes / ms / 1e6
                row[f"{fmt}_vs_bf16"] = row["bf16_ms"] / ms
            out["timing"].append(row)


def _ms(fn, args) -> float:
    import torch

    reps = 2 if args.smoke else 50
    fn()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu", action="store_true", help="Triton's interpreter (tests only)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    args = p.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is imported
    args.device = "cpu" if args.cpu else "cuda"
    out: dict = {"device": args.device, **git_tree(), "correctness": [], "timing": []}
    for part in (check, timing):
        try:
            part(out, args)
        except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others
            out.setdefault("errors", []).append(f"{part.__name__}: {type(e).__name__}: {e}")
    if args.device == "cuda":
        import torch

        out["card"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out.get("errors", "ok")), file=sys.stderr)


if __name__ == "__main__":
    main()
