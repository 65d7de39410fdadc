"""The batched LoRA op (``warmboot.kernels.lora.lora_add``) at decode, next to its linear's GEMM.

- A Qwen2-0.5B-like layer's linears (hidden 896): q/k/v packed (896 + 128 + 128), o (896),
  gate/up packed (2 x 4864), down (4864 -> 896); ``--shapes smollm``: the demo model's
  (SmolLM-135M, hidden 576: 576 + 192 + 192, 576, 2 x 1536, 1536 -> 576); 8 adapter slots,
  ranks 8 and 64.
- 8 decode rows, their slots round-robin over 0, 1, 4 or 8 distinct adapters in slots
  0..n-1 (0: the base alone, an inactive plan); bf16 and fp32.
- ``op``: ``lora_add``'s torch form (``lora.NATIVE`` off: the masked dense form over the
  slots the rows use, one expand GEMM a shard); ``native op``: ``lora_add`` as the CPU runs
  it (``csrc/lora.cpp``, one call a linear), where the library is loaded; at 8 adapters
  also ``bgmv``: the torch form forced to gather each row's A and B (``DENSE_SPAN = 0``),
  and for packed linears ``block-diagonal B``: one expand GEMM over the shards' B
  block-diagonal (the layout not kept).
- ``base``: ``F.linear`` on the linear's weight; ``native``: the packed native bf16 GEMM the
  CPU engine runs (``kernels.step_ops.pack_weight``), where it builds.

Steady state: each case cycles through copies of its weights (or stacks) adding up to
``--mb`` MB or more, so a call reads them from beyond L2, as a step's layers do; every case
is warmed, then rounds interleave all cases of a linear (drift hits them alike); a case's
figure is the median over rounds of its per-call time. The plan is built once per case, as
a step builds it once for all its layers. Prints a table; writes nothing unless ``--json``.
``python -m bench.lora_op [--quick] [--threads N] [--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn import functional as F

from bench.common import report_meta
from bench.timing import interleaved
from warmboot.kernels import lora, native
from warmboot.kernels.lora import LoraStack, lora_add, lora_rows

SHAPES = {
    "qwen": {
        "qkv": (896, [896, 128, 128]),
        "o": (896, [896]),
        "gate_up": (896, [4864, 4864]),
        "down": (4864, [896]),
    },
    "smollm": {
        "qkv": (576, [576, 192, 192]),
        "o": (576, [576]),
        "gate_up": (576, [1536, 1536]),
        "down": (1536, [576]),
    },
}
LINEARS = dict(SHAPES["qwen"])
BATCH, SLOTS, DISTINCT = 8, 8, (0, 1, 4, 8)


def copies_of(make, nbytes: int, mb: float) -> list:
    return [make() for _ in range(max(2, int(mb * 1e6 / nbytes) + 1))]


def stack(inn: int, shards: list[int], rank: int, dtype, device) -> LoraStack:
    s = LoraStack(SLOTS, rank, inn, shards, dtype, device)
    s.a[:SLOTS].normal_(0, 0.05)
    for bt in s.bs:
        bt[:SLOTS].normal_(0, 0.05)
    return s


def timer(fn, items: list, sync):
    """A run: seconds a call of ``fn`` on each of ``items`` in turn."""

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        sync()
        return (time.perf_counter() - t0) / len(items)

    return run


def torch_form(y, x, st, rows, span=None):
    """``lora_add`` with the native op off (and ``DENSE_SPAN`` at ``span`` where given)."""
    was = lora.NATIVE, lora.DENSE_SPAN
    lora.NATIVE, lora.DENSE_SPAN = False, was[1] if span is None else span
    try:
        return lora_add(y, x, st, rows)
    finally:
        lora.NATIVE, lora.DENSE_SPAN = was


def block_diagonal(st: LoraStack, rows):
    """The decode op with the shards' B block-diagonal in one (R, out) matrix a slot: one
    expand GEMM, its zero blocks read (the form not kept)."""
    bt = st.b.transpose(1, 2).contiguous()
    lo, hi = rows.window
    inn, out = st.a.shape[2], bt.shape[2]
    mask = (rows.decode_slots[:, None, None] == torch.arange(lo, hi)[:, None]).to(st.a.dtype)

    def run(y, x):
        h = (x @ st.a[lo:hi].reshape(-1, inn).T).view(x.shape[0], hi - lo, -1) * mask
        return torch.addmm(y, h.view(x.shape[0], -1), bt[lo:hi].reshape(-1, out))

    return run


def cases(name: str, rank: int, dtype, device, mb: float, sync) -> dict:
    """Every timed run of one linear at one rank and dtype."""
    inn, shards = LINEARS[name]
    out, g = sum(shards), torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, inn, generator=g).to(dtype).to(device)
    y = torch.randn(BATCH, out, generator=g).to(dtype).to(device)
    size = torch.finfo(dtype).bits // 8
    ws = copies_of(lambda: torch.randn(out, inn, dtype=dtype, device=device), out * inn * size, mb)
    runs = {"base": timer(lambda w: F.linear(x, w), ws, sync)}
    if dtype == torch.bfloat16 and device == "cpu" and native.library() is not None:
        from warmboot.kernels.step_ops import pack_weight, packed_gemm

        packed = [pack_weight(w, "native") for w in ws]
        runs["native"] = timer(lambda p: packed_gemm(x, p, None, out), packed, sync)
    del ws
    st_bytes = (SLOTS + 1) * rank * (len(shards) * inn + out) * size
    sts = copies_of(lambda: stack(inn, shards, rank, dtype, device), st_bytes, mb)
    for n in DISTINCT:
        slots = [i % n if n else None for i in range(BATCH)]
        rows = lora_rows(slots, [1] * BATCH, SLOTS, lambda t: t.to(device))
        runs[f"op {n}"] = timer(lambda s, rows=rows: torch_form(y, x, s, rows), sts, sync)
        if n and lora.uses_native(y, x, sts[0]):
            runs[f"native op {n}"] = timer(lambda s, rows=rows: lora_add(y, x, s, rows), sts, sync)
    runs["bgmv 8"] = timer(lambda s: torch_form(y, x, s, rows, span=0), sts, sync)
    if len(shards) > 1:
        diag = [block_diagonal(s, rows) for s in sts]
        runs["block-diagonal 8"] = timer(lambda f: f(y, x), diag, sync)
    return runs


def measure(args, sync) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for rank in (8, 64):
            for name in LINEARS:
                runs = cases(name, rank, dtype, args.device, args.mb, sync)
                for run in runs.values():
                    run()  # NOTE: warm-up
                got = interleaved(args.rounds, runs)
                us = {k: statistics.median(v) * 1e6 for k, v in got.items()}
                row = {"dtype": str(dtype).split(".")[1], "rank": rank, "linear": name}
                rows.append(row | {"us": us})
                print(line(rows[-1]), flush=True)
    return rows


def cell(us: dict, key: str) -> str:
    if key not in us:
        return "-"
    return f"{us[key]:.1f} ({100 * us[key] / us['base']:.0f}%)"


def line(r: dict) -> str:
    us = r["us"]
    cells = [r["dtype"], r["rank"], r["linear"], f"{us['base']:.1f}", cell(us, "native")]
    cells += [cell(us, f"op {n}") for n in DISTINCT]
    cells += [cell(us, f"native op {n}") for n in DISTINCT if n]
    cells += [cell(us, "bgmv 8"), cell(us, "block-diagonal 8")]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def totals(rows: list[dict]) -> list[dict]:
    """A layer's four linears summed, per dtype and rank."""
    out = []
    for dtype, rank in dict.fromkeys((r["dtype"], r["rank"]) for r in rows):
        mine = [r["us"] for r in rows if (r["dtype"], r["rank"]) == (dtype, rank)]
        keys = set.intersection(*(set(u) for u in mine))
        us = {k: sum(u[k] for u in mine) for k in keys}
        out.append({"dtype": dtype, "rank": rank, "linear": "layer", "us": us})
    return out


HEAD = (
    "| dtype | rank | linear | base us | native GEMM us (% base) | "
    + " | ".join(f"op, {n} adapters" for n in DISTINCT)
    + " | "
    + " | ".join(f"native op, {n}" for n in DISTINCT if n)
    + " | bgmv, 8 | block-diagonal B, 8 |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, 8 MB of copies")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=float, default=32.0, help="MB of weight copies a case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen", help="the layer's")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.mb = 3, 8.0
    LINEARS.clear()
    LINEARS.update(SHAPES[args.shapes])
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    meta = report_meta(
        threads=args.threads, device=args.device, rounds=args.rounds, mb=args.mb, shapes=args.shapes
    )
    print(meta, flush=True)
    print(HEAD + "\n" + "|---" * HEAD.count(" | ") + "|---|", flush=True)
    rows = measure(args, sync)
    print("\n" + HEAD + "\n" + "|---" * HEAD.count(" | ") + "|---|")
    print("\n".join(line(r) for r in rows + totals(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta | {"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
