"""LoRA's cost on a decode step: batch 8 of the demo model (SmolLM-135M's shape, bf16,
compiled steps, steady state), its rows on 0, 1, 4 or 8 distinct adapters of rank 8 and 64
(every linear of every layer adapted), against the same batch on an engine without LoRA; and
how long an adapter takes to load (read, check, lay out) and to reach its device slot.

Run from the repository root: ``python -m bench.lora [--rounds 2] [--out docs/benchmarks]``.
Writes ``lora.{json,md,png}``. The adapters are written here in peft's layout (random factors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import OUT, md_table, pyplot, report_meta, save_report
from bench.timing import interleaved

BATCH, PROMPT, NEW = 8, 16, 48
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COUNTS = (0, 1, 4, 8)
RANKS = (8, 64)


def write_adapter(out: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A peft LoRA adapter for every linear of the model ``cfg`` describes."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(
                torch.bfloat16
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    config |= {"bias": "none", "base_model_name_or_path": "demo"}
    (out / "adapter_config.json").write_text(json.dumps(config | {"target_modules": list(TARGETS)}))
    return out


def decode_step_ms(llm, prompts: list, loras: list) -> float:
    """Median wall ms of the decode steps of one batch (the prefill step left out)."""
    from warmboot import SamplingParams

    params = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    for p, lr in zip(prompts, loras, strict=True):
        llm.engine.add_request(None, p, params, lora_request=lr)
    times = []
    while llm.engine.has_unfinished_requests():
        t0 = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def engine(model: Path, rank: int | None):
    from warmboot import LLM

    lora = {} if rank is None else dict(enable_lora=True, max_loras=8, max_lora_rank=rank)
    return LLM(str(model), dtype="bfloat16", wait_for_compile=True, max_num_seqs=8, **lora)


def measure(model: Path, adapters: dict, rounds: int) -> list[dict]:
    from warmboot import LoRARequest

    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(PROMPT)]} for i in range(BATCH)]
    base = engine(model, None)
    runs = {("base", 0, 0): lambda: decode_step_ms(base, prompts, [None] * BATCH)}
    engines = {rank: engine(model, rank) for rank in RANKS}
    for rank, llm in engines.items():
        reqs = [LoRARequest(f"r{rank}-{i}", i + 1, str(p)) for i, p in enumerate(adapters[rank])]
        for count in COUNTS:
            loras = [reqs[i % count] if count else None for i in range(BATCH)]
            runs[("lora", rank, count)] = lambda llm=llm, loras=loras: decode_step_ms(
                llm, prompts, loras
            )
    for run in runs.values():  # NOTE: a warm-up of each: adapters loaded, caches warm
        run()
    samples = interleaved(rounds, runs)
    return [
        {"engine": k[0], "rank": k[1], "adapters": k[2], "ms": min(v), "samples": v}
        for k, v in samples.items()
    ]


def load_times(model: Path, adapters: dict) -> dict:
    """Seconds to read, check and lay out one adapter of each rank, and to write it into a
    device slot (the first step that needs it)."""
    from warmboot import LoRARequest, SamplingParams

    out = {}
    for rank in RANKS:
        llm = engine(model, rank)
        t0 = time.perf_counter()
        llm.engine.check_lora(LoRARequest("x", 1, str(adapters[rank][0])))
        read = time.perf_counter() - t0
        lora = llm.engine.lora
        t0 = time.perf_counter()
        lora.targets.slots["x"] = 0
        lora.targets.load(lora.resolved("x"))
        out[rank] = {"read_s": read, "slot_s": time.perf_counter() - t0}
        llm.generate("warm", SamplingParams(max_tokens=1))
        llm.close()
    return out


def page(rows: list[dict], loads: dict) -> list[str]:
    base = next(r["ms"] for r in rows if r["engine"] == "base")
    lines = [
        "# LoRA: a decode step with adapters",
        "",
        f"Batch {BATCH} decode steps of the demo model (bf16, compiled steps, steady state: the",
        f"median of a {NEW}-token batch's decode steps, the lower of the interleaved rounds);",
        "every linear of every layer adapted. Base: the same batch on an engine without LoRA.",
        "Decode rows go through the native kernel on the CPU (`kernels/native/csrc/lora.cpp`).",
        "",
        *md_table(
            ["adapters", "rank", "step ms", "x base"],
            "rrrr",
            [["none (LoRA off)", "-", f"{base:.2f}", "1.00x"]]
            + [
                [r["adapters"], r["rank"], f"{r['ms']:.2f}", f"{r['ms'] / base:.2f}x"]
                for r in rows
                if r["engine"] == "lora"
            ],
        ),
        "",
        "Loading an adapter (every linear of 30 layers): read and checked, then written into",
        "its device slot by the first step that uses it (the first load also allocates the",
        "stacks of the linears it touches).",
        "",
        *md_table(
            ["rank", "read + check + lay out s", "into its slot s"],
            "rrr",
            [[k, f"{v['read_s']:.3f}", f"{v['slot_s']:.3f}"] for k, v in loads.items()],
        ),
    ]
    return lines


def figure(rows: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    base = next(r["ms"] for r in rows if r["engine"] == "base")
    for rank in RANKS:
        pts = [(r["adapters"], r["ms"]) for r in rows if r["rank"] == rank]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"rank {rank}")
    ax.axhline(base, color="grey", linestyle="--", label="LoRA off")
    ax.set_xlabel(f"distinct adapters in the batch of {BATCH}")
    ax.set_ylabel("decode step, ms")
    ax.legend()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from warmboot.models.demo import ensure_default_model

    model = ensure_default_model()
    cfg = json.loads((model / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            rank: [write_adapter(Path(tmp) / f"r{rank}-{i}", cfg, rank, i) for i in range(8)]
            for rank in RANKS
        }
        rows = measure(model, adapters, args.rounds)
        loads = load_times(model, adapters)
    meta = report_meta(batch=BATCH, new_tokens=NEW, rounds=args.rounds, loads=loads)
    save_report(args.out, "lora", meta, rows, page(rows, loads), figure(rows))


if __name__ == "__main__":
    main()
