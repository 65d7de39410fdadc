"""What an offline user gets from ``LLM(model)`` + one ``generate``, in a fresh process each:
warmboot returning at once (its default: eager steps serve while the compile runs behind)
against ``wait_for_compile=True`` (vLLM's behaviour: return compiled), with inductor's caches
cold (a fresh machine: a new ``TORCHINDUCTOR_CACHE_DIR``) and warm (a later process on the
same machine), and vLLM's CPU build (``LLM()`` + ``generate`` in its own venv) where its peer
venv exists. The steady state (the same batch once the compile has landed) is ``decode.py``'s.

The built-in demo model, ``--prompt-len`` random tokens, ``--new-tokens`` new, greedy, EOS
ignored, batches 1 / 8 / 32 by default; rounds interleaved. Writes
``docs/benchmarks/first_batch.{json,md,png}``.
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

from bench.common import OUT, pyplot, report_meta, save_report
from bench.timing import median_where

CASES = ("return at once", "wait_for_compile")


def one_run(spec: dict) -> dict:
    """In this fresh process: ``LLM()`` + one ``generate``; seconds of each and the steps."""
    t0 = time.perf_counter()
    from bench.checkpoints import prompts_for
    from warmboot import LLM, SamplingParams

    llm = LLM(
        spec["model"],
        wait_for_compile=spec["wait"],
        max_num_seqs=max(spec["batch"], 8),
        max_num_batched_tokens=max(2048, spec["batch"] * spec["prompt_len"]),
    )
    t1 = time.perf_counter()
    vocab = llm.engine.model_config.vocab_size
    prompts = prompts_for(spec["batch"], spec["prompt_len"], vocab, seed=spec["batch"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    t2 = time.perf_counter()
    stats = llm.stats()
    out = {"import_and_init_s": t1 - t0, "generate_s": t2 - t1, "total_s": t2 - t0}
    out |= {"steps": stats["last_generate_steps"], "dtype": str(llm.engine.runner.dtype)}
    out["step_choice"] = stats["compile"].get("step_choice", {}).get("mode")
    llm.close()
    return out


def run_child(spec: dict, inductor_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir}
    argv = [sys.executable, "-m", "bench.first_batch", "--one", json.dumps(spec)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=OUT.parent.parent)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_vllm(model: str, batch: int, prompt_len: int, new_tokens: int) -> dict | None:
    from bench.checkpoints import prompts_for
    from bench.peers import vllm_cpu

    if not vllm_cpu._marker().exists():  # NOTE: its venv is built by decode.py, not here
        return None
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(batch, prompt_len, vocab, seed=batch)
    engine = vllm_cpu.VllmDecoder(
        model, dtype="auto", max_model_len=prompt_len + new_tokens + 8, max_num_seqs=max(batch, 8)
    )
    try:
        generate_s = engine.run(prompts, new_tokens)[0]
    finally:
        engine.close()
    init = engine.ready_s  # NOTE: spawn to ready: interpreter, vllm import, ``LLM(...)``
    return {"import_and_init_s": init, "generate_s": generate_s, "total_s": init + generate_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(json.loads(args.one))), flush=True)
        return
    from warmboot.models.demo import ensure_default_model

    model = str(ensure_default_model())
    warm_dir = tempfile.mkdtemp(prefix="wb-inductor-warm-")
    base = {"model": model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    run_child(base | {"batch": 1, "wait": True}, warm_dir)  # NOTE: primes the warm cache
    rows = []
    for rnd in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            for caches in ("cold", "warm"):
                for wait in (False, True):
                    inductor = warm_dir if caches == "warm" else tempfile.mkdtemp(prefix="wb-i-")
                    got = run_child(base | {"batch": batch, "wait": wait}, inductor)
                    rows.append(
                        {"round": rnd, "batch": batch, "caches": caches, "case": CASES[wait]} | got
                    )
                    print(json.dumps(rows[-1]), flush=True)
            if not args.no_vllm:
                got = run_vllm(model, batch, args.prompt_len, args.new_tokens)
                if got is not None:
                    rows.append({"round": rnd, "batch": batch, "caches": "warm", "case": "vLLM"})
                    rows[-1] |= got
                    print(json.dumps(rows[-1]), flush=True)
    write_report(args, rows)


def write_report(args, rows: list[dict]) -> None:
    batches = sorted({r["batch"] for r in rows})
    meta = report_meta(prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    head = f"{meta['date']} · {meta['machine']} · demo model, dtype {rows[0].get('dtype')}"
    lines = [
        "# First batch: `LLM(model)` + one `generate`, each in a fresh process",
        "",
        f"{head} · prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy · median of "
        f"{args.rounds} interleaved rounds · seconds from process start (imports included) to "
        "the batch's last token · `python -m bench.first_batch`",
        "",
        "| batch | inductor caches | case | LLM() s | generate s | total s | steps of the batch |",
        "| ---: | :--- | :--- | ---: | ---: | ---: | :--- |",
    ]
    for batch in batches:
        for caches, case in [(c, k) for c in ("cold", "warm") for k in CASES] + [("warm", "vLLM")]:
            match = {"batch": batch, "caches": caches, "case": case}
            total = median_where(rows, "total_s", **match)
            if total is None:
                continue
            steps = next(
                r.get("steps", "") for r in rows if all(r[k] == v for k, v in match.items())
            )
            init, gen = (
                median_where(rows, k, **match) for k in ("import_and_init_s", "generate_s")
            )
            lines.append(
                f"| {batch} | {caches} | {case} | {init:.1f} | {gen:.1f} | {total:.1f} "
                f"| {json.dumps(steps) if steps else '-'} |"
            )
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, caches in zip(axes, ("cold", "warm"), strict=True):
        for case in (*CASES, "vLLM"):
            ys = [median_where(rows, "total_s", batch=b, caches=caches, case=case) for b in batches]
            if any(y is not None for y in ys):
                ax.plot(batches, ys, marker="o", label=case)
        ax.set(title=f"inductor caches {caches}", xlabel="batch", xscale="log", xticks=batches)
        ax.set_xticklabels(batches)
        ax.legend()
    axes[0].set_ylabel("seconds, process start to last token")
    save_report(args.out, "first_batch", meta, rows, lines, fig)


if __name__ == "__main__":
    main()
