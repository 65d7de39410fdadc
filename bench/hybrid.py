"""A hybrid model against its attention-only twin (issue 52): memory per request as the
context grows, and batch-1 decode speed.

Two random checkpoints built by transformers (bf16, ``Qwen3_5TextConfig``, a byte-level BPE
tokenizer): the hybrid with Qwen3.5's layer pattern (three gated DeltaNet layers to one gated
attention layer) and its twin with every layer gated attention, same width, heads and MLP.

- Memory per request at 1k / 8k / 32k tokens of context: the engine's own figures
  (``stats()``: KV bytes per token of the attention layers, state bytes per request), the
  allocation each request gets, not an estimate.
- Decode tok/s at batch 1 after a prompt of each ``--contexts`` length (steady state: the
  engine built and compiled first; from the first streamed token to the last, so the
  prefill is left out), rounds interleaved, median kept. The hybrid runs twice a round: with
  the native decode steps of its state layers (``kernels.state_steps``, where the native
  library loads) and with torch's steps (``TORCH_STEPS``), the A/B of those kernels.

vLLM's CPU build is not run here (see the report's note).

    python -m bench.hybrid [--rounds 2] [--contexts 512,2048] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import OUT, pyplot, report_meta, save_report

NEW = 33
MEMORY_CONTEXTS = (1024, 8192, 32768)
L, F = "linear_attention", "full_attention"
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
MODELS = {"hybrid": [L, L, L, F] * 2, "attention-only twin": [F] * 8}
TORCH_STEPS = "hybrid, torch state steps"


def build(name: str, root: Path) -> Path:
    import torch
    import transformers

    from warmboot.tokenizer.train import train_tokenizer

    out = root / name.split()[0]
    config = transformers.Qwen3_5TextConfig(**SHAPE, layer_types=MODELS[name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    train_tokenizer(out, SHAPE["vocab_size"])
    return out


def engine(path: Path, max_len: int, dtype: str):
    from warmboot import LLM

    llm = LLM(str(path), dtype=dtype, max_model_len=max_len, max_num_seqs=1)
    llm.engine.wait_compiled()
    return llm


def decode_rate(llm, context: int) -> float:
    """Tokens/s between the first streamed token (the prefill's) and the last."""
    from warmboot import SamplingParams

    rng = random.Random(context)
    prompt = {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(context)]}
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, output_kind="delta")
    times = []
    for out in llm.generate_stream(prompt, params):
        times += [time.perf_counter()] * len(out.outputs[0].delta_token_ids)
    assert len(times) == NEW, f"{len(times)} tokens streamed"
    return (NEW - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dtype", default="bfloat16", help="float32 where bf16 does not compile")
    args = ap.parse_args()
    from warmboot.kernels import native, state_steps

    contexts = [int(c) for c in args.contexts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="wb-hybrid-"))
    max_len = max(contexts) + NEW
    engines = {name: engine(build(name, root), max_len, args.dtype) for name in MODELS}
    compiled = {name: llm.stats()["compile"]["compiled"] for name, llm in engines.items()}
    memory = {}
    for name, llm in engines.items():
        s = llm.stats()
        per_token, state = s["kv_bytes_per_token"], s["state_bytes_per_request"]
        memory[name] = {c: per_token * c + state for c in MEMORY_CONTEXTS}
        memory[name] |= {"kv_bytes_per_token": per_token, "state_bytes_per_request": state}
    load = [round(os.getloadavg()[0], 2)]
    runs = [*MODELS, TORCH_STEPS]
    rates: dict[str, dict[int, list[float]]] = {n: {c: [] for c in contexts} for n in runs}
    for r in range(args.rounds):
        order = runs if r % 2 == 0 else list(reversed(runs))
        for c in contexts:
            for name in order:
                state_steps.ENABLED = name != TORCH_STEPS
                rates[name][c].append(decode_rate(engines[name.split(",")[0]], c))
    state_steps.ENABLED = True
    native_steps = native.library() is not None
    meta = report_meta(
        model=SHAPE,
        layers=MODELS,
        new_tokens=NEW,
        dtype=args.dtype,
        compiled=compiled,
        native_state_steps=native_steps,
        load=[*load, round(os.getloadavg()[0], 2)],
    )
    report(meta, memory, rates, contexts, args.out)


def report(meta: dict, memory: dict, rates: dict, contexts: list[int], out: Path) -> None:
    mib = 1024 * 1024
    lines = [
        "# Hybrid model vs its attention-only twin (issue 52)",
        "",
        f"{meta['date']}, {meta['machine']}. Random Qwen3.5-shaped checkpoints in "
        f"{meta['dtype']} (compiled steps: {meta['compiled']}), 8 layers,",
        "hidden 1024; the hybrid has Qwen3.5's pattern (3 gated DeltaNet layers : 1 gated",
        "attention layer), the twin gated attention in every layer. `python -m bench.hybrid`.",
        "",
        "## Memory per request (the engine's allocation: KV of the attention layers + state)",
        "",
        "| model | KV bytes/token | state bytes/request | "
        + " | ".join(f"{c // 1024}k context" for c in MEMORY_CONTEXTS)
        + " |",
        "| --- | --- | --- |" + " --- |" * len(MEMORY_CONTEXTS),
    ]
    for name, m in memory.items():
        cells = " | ".join(f"{m[c] / mib:.1f} MiB" for c in MEMORY_CONTEXTS)
        lines.append(
            f"| {name} | {m['kv_bytes_per_token']} | {m['state_bytes_per_request']} | {cells} |"
        )
    lines += [
        "",
        "## Decode tok/s at batch 1, steady state (median of rounds; each in the JSON)",
        "",
        "| context | " + " | ".join(rates) + " | hybrid / twin | native / torch state steps |",
        "| --- |" + " --- |" * (len(rates) + 2),
    ]
    rows = []
    for c in contexts:
        med = {n: statistics.median(rates[n][c]) for n in rates}
        hybrid, twin, torch_steps = med.values()
        lines.append(
            f"| {c} | "
            + " | ".join(f"{v:.1f}" for v in med.values())
            + f" | {hybrid / twin:.2f}x | {hybrid / torch_steps:.2f}x |"
        )
        rows.append({"context": c, "rounds": {n: rates[n][c] for n in rates}})
    lines += [
        "",
        f"Native state steps loaded: {meta['native_state_steps']} (the hybrid column; the torch",
        "column runs the same engine with `kernels.state_steps.ENABLED` off: its state rows",
        "gathered, stepped by torch ops and scattered back). Load average (1 min) before and",
        f"after the runs: {meta['load']} on a machine shared with other work.",
        "",
        "vLLM's CPU build (0.32.0) cannot load this model here: its Qwen3.5 class imports",
        "torchvision, which its CPU venv lacks. It serves a Granite 4-shaped dense hybrid in",
        "float32 and Qwen3-Next in bf16: `hybrid_vllm/decode.md` (`bench.hybrid_vllm`) has",
        "warmboot beside it on the Granite one. Where the hybrid trails its twin (short contexts),",
        "most of the gap is its larger projections (a DeltaNet layer's in_proj + out_proj",
        "outweigh a gated attention layer's q/k/v/o here), read once a token.",
    ]
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, m in memory.items():
        ax1.plot(MEMORY_CONTEXTS, [m[c] / mib for c in MEMORY_CONTEXTS], marker="o", label=name)
    for name in rates:
        ax2.plot(
            contexts, [statistics.median(rates[name][c]) for c in contexts], marker="o", label=name
        )
    ax1.set(xlabel="context (tokens)", ylabel="MiB per request", title="memory per request")
    ax2.set(xlabel="context (tokens)", ylabel="tok/s", title="decode, batch 1")
    ax1.legend()
    ax2.legend()
    save_report(out, "hybrid", meta | {"memory": memory}, rows, lines, fig)


if __name__ == "__main__":
    main()
