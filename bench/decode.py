"""Decode throughput: compiled and eager warmboot vs vLLM's CPU build and transformers, on
the same model in the same run, fp32 and bf16.

Prompt 128 random tokens, 128 new tokens, greedy, EOS ignored, batch 1 / 8 / 32, offline APIs
(``LLM.generate`` each). vLLM runs in its own venv under the cache (``bench/peers``), started
once per dtype and driven run by run, so the engines' runs interleave and drift hits all alike.
Reports output tokens/s (prefill included, as a user sees it) and the ratios to vLLM, checks
token agreement, and writes ``docs/benchmarks/decode.{json,md,png}``. These are steady-state
figures (each engine's compile done before the first timed run); what a user gets from
``LLM()`` + one ``generate`` in a fresh process is ``bench/first_batch.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.checkpoints import prompts_for
from bench.common import OUT, cpu_name, pyplot, report_meta, save_figure, write_json, write_page
from warmboot import LLM, SamplingParams
from warmboot.models.demo import ensure_default_model


def run_warmboot(llm: LLM, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    llm.engine.block_manager.reset_prefix_cache()  # NOTE: no help from earlier repetitions
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def run_transformers(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)  # left padding, as transformers expects
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - t0, out[:, width:].tolist()


ENGINES = ("warmboot", "warmboot_eager", "vllm", "transformers")
SPLIT = ("warmboot", "warmboot_eager", "vllm")
"""Engines whose prefill (a one-token run) and decode are also reported apart."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: the built-in demo model)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--prefill-runs",
        type=int,
        default=3,
        help="one-token runs per repeat for the prefill figure (a single one swings 15%%)",
    )
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out (no peer venv)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model_dir = args.model or str(ensure_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    rows, boots, steps = [], {}, {}
    for dtype in args.dtypes.split(","):
        engines = start_engines(args, model_dir, dtype, max(batches))
        boots[dtype] = {k: v for k, v in engines.items() if k.endswith("_boot_s")}
        steps[dtype] = engines["warmboot_step"]
        try:
            for batch in batches:
                rows.append(measure(args, engines, dtype, batch))
        finally:
            if engines.get("vllm") is not None:
                engines["vllm"].close()
    write_report(args, model_dir, rows, boots, steps)


def start_engines(args, model_dir: str, dtype: str, top: int) -> dict:
    from transformers import AutoModelForCausalLM

    max_len = 2 * args.prompt_len + args.new_tokens
    kw = dict(dtype=dtype, max_model_len=max_len, max_num_seqs=top)
    kw["max_num_batched_tokens"] = top * args.prompt_len
    out: dict = {}
    # NOTE: warmboot's default (None): compiled or eager, and the GEMM, as measured at start
    for name, eager in (("warmboot", None), ("warmboot_eager", True)):
        t0 = time.perf_counter()
        out[name] = LLM(model_dir, enforce_eager=eager, **kw)
        out[name].engine.wait_compiled()  # NOTE: the default compiles in the background
        out[f"{name}_boot_s"] = time.perf_counter() - t0
    torch_dtype = getattr(torch, dtype)
    out["warmboot_step"] = out["warmboot"].engine.stats()["compile"].get("step_choice")
    out["transformers"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    out["vllm"] = None
    if not args.no_vllm:
        from bench.peers import vllm_cpu

        t0 = time.perf_counter()
        out["vllm"] = vllm_cpu.VllmDecoder(
            model_dir,
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=top,
            max_num_batched_tokens=top * args.prompt_len,
        )
        out["vllm_boot_s"] = time.perf_counter() - t0
        out["vllm"].pause()  # NOTE: each engine is measured alone (``run_engine``)
        out["vllm_version"] = out["vllm"].version
    return out


def measure(args, engines: dict, dtype: str, batch: int) -> dict:
    vocab = engines["warmboot"].engine.model_config.vocab_size
    prompts = prompts_for(batch, args.prompt_len, vocab, seed=batch)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    firsts: dict[str, list[float]] = {e: [] for e in SPLIT}
    tokens: dict[str, list] = {}
    for _ in range(args.repeats):  # interleaved, so drift hits every engine alike
        for name in ENGINES:
            if engines.get(name) is None:
                continue
            t, tokens[name] = run_engine(name, engines[name], prompts, args.new_tokens)
            times[name].append(t)
            for _ in range(args.prefill_runs if name in SPLIT else 0):  # NOTE: one new token
                firsts[name].append(run_engine(name, engines[name], prompts, 1)[0])
    n = batch * args.new_tokens
    row = {"dtype": dtype, "batch": batch, "seconds": times, "prefill_seconds": firsts}
    for name, ts in times.items():
        row[f"{name}_tok_s"] = n / statistics.median(ts) if ts else None
    for name, ts in firsts.items():
        if ts:
            first, total = statistics.median(ts), statistics.median(times[name])
            row[f"{name}_prefill_tok_s"] = batch * args.prompt_len / first
            row[f"{name}_decode_tok_s"] = batch * (args.new_tokens - 1) / max(total - first, 1e-9)
    ref = tokens["warmboot"]
    row["same_tokens"] = {k: _agreement(ref, v) for k, v in tokens.items() if k != "warmboot"}
    if row["vllm_tok_s"]:
        row["ratio_vs_vllm"] = row["warmboot_tok_s"] / row["vllm_tok_s"]
        row["eager_ratio_vs_vllm"] = row["warmboot_eager_tok_s"] / row["vllm_tok_s"]
        for part in ("prefill", "decode"):
            row[f"{part}_ratio_vs_vllm"] = row[f"warmboot_{part}_tok_s"] / row[f"vllm_{part}_tok_s"]
    print(json.dumps({k: v for k, v in row.items() if k != "seconds"}), flush=True)
    return row


def run_engine(name: str, engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    if name == "transformers":
        return run_transformers(engine, prompts, new_tokens)
    if name == "vllm":
        engine.pause(False)
        try:
            return engine.run(prompts, new_tokens)
        finally:
            engine.pause()  # NOTE: its idle processes would share the cores with the others
    return run_warmboot(engine, prompts, new_tokens)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of the rows whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def write_report(args, model_dir: str, rows: list[dict], boots: dict, steps: dict) -> None:
    import transformers

    meta = report_meta(
        machine=f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}",
        transformers=transformers.__version__,
        vllm=None if args.no_vllm else "vllm-cpu 0.32.0",
        model=Path(model_dir).name,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        prefill_runs=args.prefill_runs,
        boot_s=boots,
        step_choice=steps,
    )
    write_json(args.out / "decode.json", {"meta": meta, "rows": rows})
    lines = [
        "# Decode throughput: warmboot (compiled, eager) vs vLLM's CPU build and transformers",
        "",
        f"{meta['date']} · {meta['machine']} · {meta['vllm']} (own venv, its defaults: compiled, "
        "one bound OpenMP thread; its processes stopped while the others run) · transformers "
        f"{meta['transformers']} · model `{meta['model']}` · prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy, EOS ignored, offline API · median of "
        f"{args.repeats} interleaved runs · warmboot at its defaults (the step measured at "
        "start, one compute thread on 2 cores) · "
        "`python bench/decode.py`",
        "",
        "| dtype | batch | warmboot tok/s | eager tok/s | vLLM tok/s | transformers tok/s "
        "| warmboot / vLLM | eager / vLLM | same tokens (eager, vLLM, transformers) |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for r in rows:
        same = r["same_tokens"]
        agree = ", ".join(f"{same.get(k, float('nan')):.0%}" for k in ENGINES[1:])
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {_f(r['warmboot_tok_s'])} | "
            f"{_f(r['warmboot_eager_tok_s'])} | {_f(r['vllm_tok_s'])} | "
            f"{_f(r['transformers_tok_s'])} | {_x(r.get('ratio_vs_vllm'))} | "
            f"{_x(r.get('eager_ratio_vs_vllm'))} | {agree} |"
        )
    lines += [
        "",
        f"Prefill (one-token runs, {args.prefill_runs} a repeat, their median: prompt tokens/s) "
        "and decode (the rest of a whole run: output tokens/s) apart:",
        "",
        "| dtype | batch | warmboot prefill | vLLM prefill | ratio | warmboot decode "
        "| eager decode | vLLM decode | ratio |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {_f(r.get('warmboot_prefill_tok_s'))} | "
            f"{_f(r.get('vllm_prefill_tok_s'))} | {_x(r.get('prefill_ratio_vs_vllm'))} | "
            f"{_f(r.get('warmboot_decode_tok_s'))} | {_f(r.get('warmboot_eager_decode_tok_s'))} | "
            f"{_f(r.get('vllm_decode_tok_s'))} | {_x(r.get('decode_ratio_vs_vllm'))} |"
        )
    lines += ["", "Start-up of each engine in this run (s): " + json.dumps(_rounded(boots))]
    keys = ("mode", "kernel", "helpers", "dense_rows")
    choice = {d: {k: c.get(k) for k in keys} for d, c in steps.items() if c}
    lines += ["", "warmboot's step as measured at its start: " + json.dumps(choice)]
    write_page(args.out / "decode.md", lines, meta)
    plot(args.out / "decode.png", meta, rows)
    print("\n".join(lines))


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _rounded(d: dict) -> dict:
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 1) for k, v in d.items()}


def plot(path: Path, meta: dict, rows: list[dict]) -> None:
    plt = pyplot()
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sub = [r for r in rows if r["dtype"] == dtype]
        width = 0.2
        for j, name in enumerate(ENGINES):
            vals = [r[f"{name}_tok_s"] or 0 for r in sub]
            ax.bar([i + (j - 1.5) * width for i in range(len(sub))], vals, width, label=name)
        for i, r in enumerate(sub):
            if r.get("ratio_vs_vllm"):
                top = max(r[f"{n}_tok_s"] or 0 for n in ENGINES)
                ax.annotate(f"{r['ratio_vs_vllm']:.2f}x", (i, top), ha="center", va="bottom")
        ax.set_xticks(range(len(sub)), [str(r["batch"]) for r in sub])
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{meta['model']} {dtype} (label: warmboot / vLLM)", fontsize=9)
        ax.legend(fontsize=7)
    fig.text(0.01, 0.01, f"{meta['date']} · {meta['machine']}", fontsize=6)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
