"""Attention kernels: correctness, then speed against torch SDPA (one call, under 5 minutes).

1. correctness: varlen forward (every mask, GQA, empty / length-1 sequences, tau 0 and 8,
   exp2 emulation) and paged decode against the float64 reference;
2. prefill TFLOP/s, head dim 64 and 128, seqlen 512 .. 16k (16k tokens per batch, 2048 hidden),
   causal and not, vs ``scaled_dot_product_attention`` with each backend (flash, cuDNN,
   efficient); columns for tau = 0, 1/8 of exp2 emulated, and the plain (non-LPT) order;
3. decode GB/s (K+V bytes read) vs a measured device-to-device copy;
4. first-call JIT compile time of each kernel, cold (empty Triton cache) and from the cache.

``python -m bench.attention --out $OUT`` on a GPU; ``--cpu`` runs only the correctness half in
Triton's interpreter at tiny sizes, and ``--cpu --smoke`` also runs parts 2 and 3 there at tiny
sizes (timings meaningless: a check of the script, which the test suite runs). Writes
``attention.json`` (``attention_cpu.json`` with ``--cpu``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import git_tree

ROOT = Path(__file__).resolve().parents[1]
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS, HIDDEN = 16384, 2048


def _cu(lens, device):
    import torch

    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


def correctness(device, tiny: bool) -> list[dict]:
    import torch

    from warmboot.kernels.attention import flash_attn_varlen_func
    from warmboot.kernels.decode import paged_decode_attention
    from warmboot.kernels.reference import paged_decode_ref, varlen_attention_ref

    g = torch.Generator().manual_seed(0)
    lens_q = [5, 0, 1, 37, 20] if tiny else [500, 0, 1, 1537, 2000]
    lens_k = [5, 0, 3, 37, 50] if tiny else [500, 0, 3, 1537, 2500]
    dtypes = [torch.float16] if tiny else [torch.float16, torch.bfloat16]
    rows = []
    cases = [
        ("none", False, (-1, -1), 0.0, 8.0, 0.0),
        ("causal", True, (-1, -1), 0.0, 8.0, 0.0),
        ("causal tau=0", True, (-1, -1), 0.0, 0.0, 0.0),
        ("causal emu=1/8", True, (-1, -1), 0.0, 8.0, 0.125),
        ("causal emu=all", True, (-1, -1), 0.0, 8.0, 1.0),
        ("window (16,4)", False, (16, 4), 0.0, 8.0, 0.0),
        ("causal+window 16", True, (16, -1), 0.0, 8.0, 0.0),
        ("softcap 20", True, (-1, -1), 20.0, 8.0, 0.0),
    ]
    if tiny:  # NOTE: the smoke checks the script's code paths; the kernel tests each case
        cases = [c for c in cases if c[0] in ("causal", "window (16,4)")]
    for dtype in dtypes:
        for d in (64,) if tiny else (64, 128):
            hq, hkv = 8, 2
            q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype).to(device)
            k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)
            v = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)
            cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
            for name, causal, window, cap, tau, emu in cases:
                out = torch.full_like(q, float("nan"))
                o, lse = flash_attn_varlen_func(
                    q,
                    k,
                    v,
                    cu_q,
                    cu_k,
                    max(lens_q),
                    max(lens_k),
                    causal=causal,
                    window_size=window,
                    softcap=cap,
                    return_lse=True,
                    tau=tau,
                    emulate_fraction=emu,
                    out=out,
                )
                ro, rl = varlen_attention_ref(q, k, v, cu_q, cu_k, None, causal, window, cap)
                fin = torch.isfinite(rl)
                rows.append(
                    dict(
                        kernel="varlen",
                        case=name,
                        dtype=str(dtype)[6:],
                        d=d,
                        rel_err=((o.double() - ro).norm() / ro.norm()).item(),
                        lse_err=(lse.double() - rl)[fin].abs().max().item(),
                        nan=bool(o.isnan().any()),
                    )
                )
        rows += _decode_correctness(
            device, dtype, tiny, g, paged_decode_attention, paged_decode_ref
        )
    return rows


def _decode_correctness(device, dtype, tiny, g, kernel, ref) -> list[dict]:
    import torch

    lens = [1, 37, 0, 70] if tiny else [1, 3000, 0, 7001]
    bs, hq, hkv, d = 16, 8, 2, 64 if tiny else 128
    nblk = [-(-n // bs) for n in lens]
    num_blocks = sum(nblk) + 5
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        table[b, :n] = perm[used : used + n]
        used += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(device)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(device)
    table, seqlens = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    rows = []
    cases = [
        ("plain", (-1, -1), 0.0, 1, 1),
        ("split 4", (-1, -1), 0.0, 4, 1),
        ("window 31", (31, 0), 0.0, 3, 1),
        ("softcap 20", (-1, -1), 20.0, 2, 1),
        ("4 tokens split 4", (-1, -1), 0.0, 4, 4),
        ("4 tokens window 31", (31, 0), 0.0, 3, 4),
    ]
    if tiny:  # one case of each reference (one token, several)
        cases = [c for c in cases if c[0] in ("split 4", "4 tokens split 4")]
    for name, window, cap, splits, qlen in cases:
        q = torch.randn(len(lens) * qlen, hq, d, generator=g).to(dtype).to(device)
        out = torch.full_like(q, float("nan"))
        kernel(q, kc, vc, table, seqlens, None, window, cap, splits, out=out, query_len=qlen)
        if qlen == 1:
            ro, _ = ref(q, kc, vc, table, seqlens, None, window, cap)
        else:
            ro = _multi_token_ref(q, kc, vc, table, seqlens, qlen, window, cap)
        rows.append(
            dict(
                kernel="decode",
                case=name,
                dtype=str(dtype)[6:],
                d=d,
                rel_err=((out.double() - ro).norm() / ro.norm()).item(),
                lse_err=None,
                nan=bool(out.isnan().any()),
            )
        )
    return rows


def _multi_token_ref(q, kc, vc, table, seqlens, qlen, window, cap):
    """float64 output of ``qlen`` causal tokens per sequence: the varlen reference over
    each sequence's keys gathered from its blocks."""
    import torch

    from warmboot.kernels.reference import varlen_attention_ref

    lens, bs = seqlens.tolist(), kc.shape[1]
    k, v = (
        torch.cat([c[table[b, : -(-n // bs)].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)])
        for c in (kc, vc)
    )
    cu_q = torch.arange(0, (len(lens) + 1) * qlen, qlen, dtype=torch.int32, device=q.device)
    return varlen_attention_ref(q, k, v, cu_q, _cu(lens, q.device), None, True, window, cap)[0]


def _bench(fn, *args, **kwargs) -> float:
    """Mean milliseconds of ``fn(*args, **kwargs)`` (two timed calls off a GPU: smoke only)."""
    import torch
    import triton.testing

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and tensors[0].device.type != "cuda":
        fn(*args, **kwargs)
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=10, rep=40)


def prefill_perf(device="cuda", seqlens=SEQLENS, tokens=TOKENS, hidden=HIDDEN, dims=(64, 128)):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from warmboot.kernels.attention import attention_flops, flash_attn_func

    sdpa = {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    rows = []
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                bsz, h = tokens // n, hidden // d
                q, k, v = (
                    torch.randn(bsz, n, h, d, device=device, dtype=torch.float16) for _ in "qkv"
                )
                flops = bsz * attention_flops([n], [n], h, d, causal)
                row = dict(d=d, causal=causal, seqlen=n, batch=bsz, heads=h)
                variants = {
                    "triton": {},
                    "triton_tau0": dict(tau=0.0),
                    "triton_emu0": dict(emulate_fraction=0.0),
                    "triton_emu1/8": dict(emulate_fraction=0.125),
                    "triton_plain_order": dict(lpt=False),
                }
                for name, kw in variants.items():
                    ms = _bench(flash_attn_func, q, k, v, causal=causal, **kw)
                    row[name] = flops / ms / 1e9
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                for name, backend in sdpa.items():
                    try:
                        with sdpa_kernel(backend):
                            ms = _bench(
                                F.scaled_dot_product_attention, qt, kt, vt, is_causal=causal
                            )
                        row[name] = flops / ms / 1e9
                    except RuntimeError:
                        row[name] = None
                rows.append(row)
                print(_fmt_perf(row), flush=True)
    return rows


DECODE_CASES = (
    (1, 16384, 1),
    (32, 4096, 1),
    (128, 2048, 1),
    (64, 8192, 1),
    (32, 4096, 4),
    (64, 8192, 4),
)
"""(batch, context, query tokens per sequence)."""


def decode_perf(device="cuda", cases=DECODE_CASES, heads=(32, 8)) -> list[dict]:
    import torch

    from warmboot.kernels.decode import paged_decode_attention

    rows = []
    (hq, hkv), d, bs = heads, 128, 16
    for batch, ctx, qlen in cases:
        nblk = ctx // bs
        num_blocks = batch * nblk
        kc = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=torch.float16)
        vc = torch.randn_like(kc)
        table = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, nblk)
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch * qlen, hq, d, device=device, dtype=torch.float16)
        ms = _bench(paged_decode_attention, q, kc, vc, table, seqlens, query_len=qlen)
        kv_bytes = 2 * kc.numel() * kc.element_size()
        src = torch.empty(kv_bytes // 2, dtype=torch.float16, device=device)
        dst = torch.empty_like(src)
        copy_ms = _bench(dst.copy_, src)
        row = dict(
            batch=batch,
            ctx=ctx,
            query_len=qlen,
            kernel_GBps=kv_bytes / ms / 1e6,
            copy_GBps=2 * kv_bytes / copy_ms / 1e6,  # read + write
        )
        row["fraction_of_copy"] = row["kernel_GBps"] / row["copy_GBps"]
        rows.append(row)
        print(row, flush=True)
    return rows


def compile_times() -> dict:
    """First call of each kernel in a fresh process: empty Triton cache, then warm cache."""
    code = (
        "import time, json, torch\n"
        "from warmboot.kernels import tuning\n"
        "from warmboot.kernels.attention import flash_attn_func\n"
        "from warmboot.kernels.decode import paged_decode_attention\n"
        "q = torch.randn(1, 1024, 16, 128, device='cuda', dtype=torch.float16)\n"
        "res = {}\n"
        "t = time.perf_counter(); flash_attn_func(q, q, q, causal=True); torch.cuda.synchronize()\n"
        "res['varlen_fwd'] = time.perf_counter() - t\n"
        "kc = torch.randn(64, 16, 16, 128, device='cuda', dtype=torch.float16)\n"
        "tb = torch.arange(64, device='cuda', dtype=torch.int32).view(1, 64)\n"
        "sl = torch.tensor([1000], device='cuda', dtype=torch.int32)\n"
        "t = time.perf_counter(); paged_decode_attention(q[0, :1], kc, kc, tb, sl, num_splits=4)\n"
        "torch.cuda.synchronize(); res['paged_decode'] = time.perf_counter() - t\n"
        "print(json.dumps(res))\n"
    )
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/triton", WARMBOOT_CACHE=f"{tmp}/wb")
        env.pop("TRITON_INTERPRET", None)
        for label in ("cold", "cached"):  # the autotune JSON persists too: cached skips tuning
            p = subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
            )
            out[label] = (
                json.loads(p.stdout.strip().splitlines()[-1])
                if p.returncode == 0
                else p.stderr[-500:]
            )
    return out


def _fmt_perf(r: dict) -> str:
    cols = [k for k in r if k.startswith(("triton", "sdpa"))]
    head = f"d={r['d']} causal={int(r['causal'])} n={r['seqlen']:>5}"
    return head + " " + " ".join(f"{c}={r[c]:.0f}" if r[c] else f"{c}=-" for c in cols)


def _print_correctness(rows: list[dict]) -> None:
    print("| kernel | case | dtype | d | rel err | LSE err | NaN |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lse = "-" if r["lse_err"] is None else f"{r['lse_err']:.1e}"
        print(
            f"| {r['kernel']} | {r['case']} | {r['dtype']} | {r['d']} | {r['rel_err']:.1e} | {lse} | {r['nan']} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--cpu", action="store_true", help="correctness only, in the interpreter")
    ap.add_argument("--smoke", action="store_true", help="with --cpu: parts 2-3 at tiny sizes")
    args = ap.parse_args()
    if args.smoke and not args.cpu:
        ap.error("--smoke runs in the interpreter: add --cpu")
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before the kernels are imported
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    device = torch.device("cpu" if args.cpu else "cuda")
    result = dict(
        date=time.strftime("%Y-%m-%d"),
        **git_tree(),
        triton=triton.__version__,
        torch=torch.__version__,
        device="interpreter (CPU)" if args.cpu else torch.cuda.get_device_name(),
    )
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("attention_cpu.json" if args.cpu else "attention.json")

    def save() -> None:  # NOTE: after every part: a run cut off by a time box keeps the rest
        result["wall_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(result, indent=1))

    result["correctness"] = correctness(device, tiny=args.cpu)
    _print_correctness(result["correctness"])
    save()
    if args.smoke:
        tiny_prefill = dict(seqlens=(32,), tokens=64, hidden=128, dims=(64,))
        for name, part in (
            ("prefill_tflops", lambda: prefill_perf("cpu", **tiny_prefill)),
            ("decode", lambda: decode_perf("cpu", ((2, 64, 1), (2, 64, 4)), (4, 2))),
        ):
            result[name] = part()
            save()
    if not args.cpu:
        for name, part in (
            ("prefill_tflops", prefill_perf),
            ("decode", decode_perf),
            ("compile_s", compile_times),
        ):
            try:
                result[name] = part()
            except Exception as e:  # noqa: BLE001 - record and go on: device time is scarce
                result.setdefault("errors", []).append(f"{name}: {e!r}")
                print("ERROR", name, e, flush=True)
            save()
        print(json.dumps(result.get("compile_s")))
    print(f"wrote {path} in {result['wall_s']:.0f}s")
    bad = [
        r
        for r in result["correctness"]
        if r["nan"] or r["rel_err"] > 2e-3 * (5 if r["dtype"] == "bfloat16" else 1)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
