"""Decode throughput: warmboot vs transformers ``generate`` on the same model, same run.

Prompt 128 random tokens, 128 new tokens, greedy, EOS ignored, batch 1 / 8 / 32. Reports output
tokens/s (prefill included, as a user sees it) and the ratio, checks that both produced the same
tokens, and writes ``docs/benchmarks/decode.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from warmboot import LLM, SamplingParams
from warmboot.models.demo import ensure_default_model

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def prompts_for(batch: int, length: int, vocab: int, seed: int, mixed: bool = False):
    """``batch`` random prompts of ``length`` tokens, or (mixed) of lengths spread evenly
    over [length / 8, 2 * length - length / 8] (same mean)."""
    g = torch.Generator().manual_seed(seed)
    lo = length // 8
    lengths = [lo + (2 * (length - lo) * i) // max(1, batch - 1) for i in range(batch)]
    lengths = lengths if mixed else [length] * batch
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: the built-in demo model)")
    ap.add_argument("--batches", default="1,8,32,32m", help="'m': mixed prompt lengths")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = args.model or str(ensure_default_model())
    configs = [(int(b.rstrip("m")), b.endswith("m")) for b in args.batches.split(",")]
    batches = [b for b, _ in configs]
    max_len = 2 * args.prompt_len + args.new_tokens
    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * args.prompt_len,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for batch, mixed in configs:
        prompts = prompts_for(batch, args.prompt_len, vocab, seed=batch, mixed=mixed)
        ours, theirs, same = [], [], True
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            t, a = run_warmboot(llm, prompts, args.new_tokens)
            ours.append(t)
            t, b = run_transformers(hf, prompts, args.new_tokens)
            theirs.append(t)
            same &= a == b
        tokens = batch * args.new_tokens
        row = {
            "batch": batch,
            "mixed_lengths": mixed,
            "warmboot_tok_s": tokens / statistics.median(ours),
            "transformers_tok_s": tokens / statistics.median(theirs),
            "identical_tokens": same,
            "warmboot_s": ours,
            "transformers_s": theirs,
        }
        row["ratio"] = row["warmboot_tok_s"] / row["transformers_tok_s"]
        rows.append(row)
        print(
            f"batch {batch:3d}{' mixed' if mixed else ''}: warmboot {row['warmboot_tok_s']:8.1f} tok/s  transformers "
            f"{row['transformers_tok_s']:8.1f} tok/s  ratio {row['ratio']:.2f}x  same={same}",
            flush=True,
        )
    write_report(args, model_dir, rows)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def write_report(args, model_dir: str, rows: list[dict]) -> None:
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "transformers": transformers.__version__,
        "model": Path(model_dir).name,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }
    (args.out / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# Decode throughput: warmboot vs transformers `generate`",
        "",
        f"{meta['date']} · {meta['machine']} · transformers {meta['transformers']} · "
        f"model `{meta['model']}` (float32) · prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, greedy, EOS ignored · median of {args.repeats} interleaved runs · "
        "`python bench/decode.py`",
        "",
        "| batch | prompt lengths | warmboot tok/s | transformers tok/s | ratio | same tokens |",
        "| ---: | :--- | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        lengths = (
            f"{args.prompt_len // 8}..{2 * args.prompt_len - args.prompt_len // 8}"
            if r["mixed_lengths"]
            else str(args.prompt_len)
        )
        lines.append(
            f"| {r['batch']} | {lengths} | {r['warmboot_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {'yes' if r['identical_tokens'] else 'no'} |"
        )
    (args.out / "decode.md").write_text("\n".join(lines) + "\n")
    plot(args.out / "decode.png", meta, rows)
    print(f"wrote {args.out / 'decode.md'}")


def plot(path: Path, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['batch']}{' mixed' if r['mixed_lengths'] else ''}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["warmboot_tok_s"] for r in rows], 0.4, label="warmboot")
    ax.bar([i + 0.2 for i in x], [r["transformers_tok_s"] for r in rows], 0.4, label="transformers")
    for i, r in enumerate(rows):
        ax.annotate(
            f"{r['ratio']:.2f}x",
            (i, max(r["warmboot_tok_s"], r["transformers_tok_s"])),
            ha="center",
            va="bottom",
        )
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Decode throughput, {meta['model']} fp32 (CPU)", fontsize=10)
    fig.text(0.01, 0.01, f"{meta['date']} · {meta['machine']}", fontsize=6)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
