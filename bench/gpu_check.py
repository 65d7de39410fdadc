"""One call on a GPU machine: correctness, then the figures, written under $OUT (or --out).

1. correctness: greedy tokens of every tiny architecture against transformers on the GPU
   (fp32): sync eager, pipelined eager and pipelined with CUDA graphs, all identical;
   then the sync sites of steady pipelined decode under torch's sync debug mode;
2. the bubble: sync vs pipelined, each eager and with CUDA graphs, on a small model
   (tokens/s, bubble fraction from CUDA events), with and without a JSON schema;
3. decode throughput of the built-in 135M model in bf16 at batch 1 / 8 / 32 / 64, eager and
   with CUDA graphs, and the graphs' capture time;
4. the cost of tuning the prefill kernel for every shape bucket at start-up (first call
   and cached), when the time box allows.

Usage: ``python -m bench.gpu_check --out $OUT``. Prints one JSON summary line at the end.
``--device cpu --smoke`` runs every part on the CPU at tiny sizes (graphs emulated, no sync
debug mode, no tuning): the test suite does, so the GPU's minutes are never spent on a
broken script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import git_tree


def make_llm(args, path, graphs: bool = False, **kw):
    """An engine on ``args.device``; graphs are captured on CUDA and emulated on the CPU."""
    from warmboot import LLM

    cuda = args.device == "cuda"
    llm = LLM(str(path), device=args.device, cuda_graphs=graphs and cuda, **kw)
    if graphs and not cuda:
        llm.engine.enable_decode_graphs(emulate=True)
    return llm


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def correctness(out: dict, args) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_greedy, random_prompts
    from tests.tiny_models import KINDS, VOCAB_SIZE, make_tiny_model
    from warmboot import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-"))
    prompts = random_prompts((5, 13, 31, 47), VOCAB_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for kind in KINDS[:2] if args.smoke else KINDS:  # NOTE: the smoke checks the code path
        path = make_tiny_model(kind, root / kind)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref = [hf_greedy(hf, p, 16) for p in prompts]
        loops = {}
        for pipelined, graphs in ((False, False), (True, False), (True, True)):
            llm = make_llm(
                args,
                path,
                graphs,
                dtype="float32",
                max_model_len=128,
                block_size=16,
                num_kv_blocks=64,
                pipelined=pipelined,
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            loops[pipelined, graphs] = [o.outputs[0].token_ids for o in outs]
        results[kind] = {
            f"{'pipelined' if p else 'sync'}_{'graphs' if g else 'eager'}_matches_hf": sum(
                a == b for a, b in zip(toks, ref, strict=True)
            )
            for (p, g), toks in loops.items()
        } | {"of": len(prompts)}
        print(kind, results[kind], flush=True)
    out["correctness"] = results


def hidden_syncs(out: dict, args) -> None:
    """The launch path must not synchronise: steady pipelined decode of a batch mixing greedy,
    seeded top-k/top-p, penalties, logprobs and a JSON schema, under torch's sync debug mode.
    Every warning names the Python line that synchronised (``collect``'s event wait is the
    one expected). On the CPU the same loop runs without the debug mode."""
    import warnings

    from bench.bubble import SCHEMA, SHAPE
    from bench.checkpoints import random_llama
    from warmboot import SamplingParams
    from warmboot.sampling_params import StructuredOutputs

    model_dir = random_llama("wb-sync-", SHAPE, dtype="bfloat16")
    llm = make_llm(args, model_dir, max_model_len=256, num_kv_blocks=512, pipelined=True)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=48),
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            max_tokens=48,
            logprobs=3,
            logit_bias={5: 2.0, 9: -3.0},
        ),
        SamplingParams(
            temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputs(json=SCHEMA)
        ),
    ]
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(16)]
    params = [kinds[i % len(kinds)] for i in range(16)]
    llm.generate(prompts, params)  # warm: compile, capture, grammar caches
    eng = llm.engine
    for i, (pr, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"s{i}", pr, sp)
    eng.step()
    eng.step()  # prefill done: from here on, steady decode
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        key = f"{Path(w.filename).name}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    out["hidden_syncs"] = {"steps": steps, "sync_sites": where if cuda else "not checked on cpu"}
    print("hidden syncs", out["hidden_syncs"], flush=True)


def bubble(out: dict, args) -> None:
    from bench.bubble import SHAPE, run
    from bench.checkpoints import random_llama

    model_dir = random_llama("wb-bubble-", SHAPE, dtype="bfloat16")
    rows = []
    configs = {
        f"{loop}_{mode}": dict(pipelined=loop == "pipelined", cuda_graphs=mode == "graphs")
        for loop in ("sync", "pipelined")
        for mode in ("eager", "graphs")
    }
    llms = {
        name: make_llm(
            args,
            model_dir,
            kw["cuda_graphs"],
            max_model_len=128,
            max_num_seqs=64,
            max_num_batched_tokens=64 * 32,
            num_kv_blocks=1024,  # NOTE: explicit, or the first engine takes 90% of the card
            pipelined=kw["pipelined"],
        )
        for name, kw in configs.items()
    }
    batches, new_tokens = ((1, 8), 8) if args.smoke else ((1, 8, 32, 64), 64)
    for schema in (False, True):
        for batch in batches:
            row = {"batch": batch, "schema": schema}
            tokens = {}
            for name, llm in llms.items():
                r = run(llm, batch, 32, new_tokens, schema)
                row[f"{name}_tok_s"], row[f"{name}_bubble"] = r["tok_s"], r["bubble"]
                tokens[name] = r["tokens_out"]
            row["sync_equals_pipelined"] = tokens["sync_eager"] == tokens["pipelined_eager"]
            row["graphs_equal_eager"] = tokens["pipelined_graphs"] == tokens["pipelined_eager"]
            print(row, flush=True)
            rows.append(row)
    out["bubble"] = rows


def decode(out: dict, args) -> None:
    from warmboot import SamplingParams
    from warmboot.models.demo import ensure_default_model

    model = ensure_default_model() if not args.smoke else _small_model()
    vocab = 49152 if not args.smoke else 4096
    # NOTE: the compiled steps next to the eager ones, each with and without CUDA graphs (the
    # CUDA default is eager steps + graphs; compiled steps are the CPU default)
    modes = {"eager": (False, False), "graphs": (True, False)}
    if not args.smoke:  # NOTE: the smoke compiles once (35 s on the CPU); same code path
        modes["compiled"] = (False, True)
    modes["compiled_graphs"] = (True, True)
    llms = {
        mode: make_llm(
            args,
            model,
            graphs,
            max_model_len=512,
            max_num_seqs=64,
            max_num_batched_tokens=64 * 128,
            num_kv_blocks=64 * 512 // 16,
            compile_steps=compiled,
            enforce_eager=False if graphs or compiled else True,
        )
        for mode, (graphs, compiled) in modes.items()
    }
    out["graph_capture_s"] = llms["graphs"].engine.startup_times.get("cuda_graphs")
    out["graphs_state"] = llms["graphs"].stats()["cuda_graphs"]
    out["compile"] = {
        m: llms[m].stats()["compile"] | {"phase_s": llms[m].engine.startup_times.get("compile")}
        for m in llms
        if m.startswith("compiled")
    }
    rows = []
    batches, new_tokens = ((1, 8), 8) if args.smoke else ((1, 8, 32, 64), 128)
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [
            {"prompt_token_ids": torch.randint(1, vocab, (128,), generator=g).tolist()}
            for _ in range(batch)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        row = {"batch": batch}
        for mode, llm in llms.items():
            llm.generate(prompts, params)  # warm
            synchronize(args)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            synchronize(args)
            wall = time.perf_counter() - t0
            row[f"{mode}_tok_s"] = batch * new_tokens / wall
            row[f"{mode}_bubble"] = llm.stats()["bubble_fraction"]
            row[f"{mode}_graph_steps"] = llm.stats()["graph_steps"]
        rows.append(row)
        print(rows[-1], flush=True)
    out["decode_bf16"] = rows


def _small_model() -> Path:
    from bench.bubble import SHAPE
    from bench.checkpoints import random_llama

    return random_llama("wb-small-", SHAPE)


def pretune(out: dict, args) -> None:
    """What ``pretune_attention`` adds to a publishing cold boot: every prefill shape bucket
    of a d128 GQA-4 model up to 1k new / 2k total tokens, tuned (first call) and cached."""
    if args.device != "cuda":
        out["pretune"] = "skipped: tuning measures kernels on a GPU"
        return
    from warmboot.kernels import tuning
    from warmboot.kernels.triton_backend import TritonAttentionBackend

    cache = torch.zeros(2048 // 16 + 1, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    args = (cache, cache, 32, 128**-0.5, {None}, 1024, 2048)
    before = len(tuning.export_autotune_cache())
    t0 = time.perf_counter()
    shapes = TritonAttentionBackend().pretune(*args)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    TritonAttentionBackend().pretune(*args)
    out["pretune"] = {
        "shapes": shapes,
        "new_keys": len(tuning.export_autotune_cache()) - before,
        "first_s": first,
        "cached_s": time.perf_counter() - t0,
    }
    print(out["pretune"], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check of the script)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script is for the GPU machine (--device cpu --smoke)")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "smoke": args.smoke,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **git_tree(),
    }
    t_start = time.perf_counter()
    for part in (correctness, hidden_syncs, bubble, decode, pretune):
        if part is pretune and time.perf_counter() - t_start > 200:
            out.setdefault("errors", []).append("pretune: skipped, the time box is near")
            continue
        try:
            part(out, args)
        except Exception as e:  # noqa: BLE001 - record and go on: device time is scarce
            out.setdefault("errors", []).append(f"{getattr(part, '__name__', 'part')}: {e!r}")
            print("ERROR", e, flush=True)
        # NOTE: after every part: a run cut off by its time box keeps what it measured
        (args.out / "gpu_check.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
