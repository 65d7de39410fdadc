"""``bench.moe``'s ``profile`` section: one torch-profiler trace of a compiled MoE decode at
batch 1, its ops' self time bucketed (router, expert GEMMs, sort/scatter, attention, ...)."""

from __future__ import annotations

import json
import time
from collections import Counter

from bench.checkpoints import prompts_for

ACTIVATION_OPS = (
    "aten::silu",
    "aten::mul",
    "aten::mul_",
    "aten::chunk",
    "aten::split",
    "aten::sigmoid",
    "aten::gelu",
    "aten::clamp",
    "warmboot_cpu::silu_mul",
)
ROUTING_WEIGHT_OPS = ("aten::matmul", "aten::mm")  # NOTE: batch 1's (1, k) @ (k, H)
EXPERT_GEMM_OPS = (
    # NOTE: the per-expert GEMM callables ``kernels.experts.grouped_experts`` is given:
    # ``step_ops.ExpertTable``'s packed (native panels or oneDNN) or dense, the quantized methods'
    "warmboot_cpu::linear",
    "warmboot_cpu::dense_linear",
    "warmboot_cpu::quant_linear",
    "warmboot_cpu::quant_linear_i8",
    "warmboot::quant_linear",
    "mkldnn::_linear_pointwise",
    "aten::linear",
)
BUCKETS = (
    "expert GEMMs",
    "expert activation, routing weights",
    "sort / gather / scatter",
    "fused_experts (Python loop)",
    "router GEMM",
    "attention",
    "other GEMMs (q/k/v, o)",
    "LM head",
    "compiled graph (norms, rope, router softmax/top-k, residuals)",
    "host (schedule, sample, commit) and the rest",
)


def profile_section(args, report: dict, wb) -> None:
    """One profiled batch-1 decode of the MoE on ``wb`` (``bench.moe.Warmboot``: compiled,
    bf16), ms per step by bucket."""
    from torch.profiler import ProfilerActivity, profile

    from warmboot import SamplingParams

    llm = wb.llm
    prompt = prompts_for(1, args.prompt_len, args.attn["vocab_size"], seed=7)[0]
    steps = 32 if not args.quick else 8
    # NOTE: the steps compile in the background and eager steps serve meanwhile (no
    # ``warmboot::`` ops in those, every bucket but the host's empty): wait for the compile
    llm.engine.wait_compiled()
    wb.run([prompt], 4)  # warm
    llm.engine.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    llm.engine.add_request(None, llm.engine.validate({"prompt_token_ids": prompt}, params))
    llm.engine.step()  # the prefill: left out of the trace
    # NOTE: the model runs on the runner's device thread (``device.streams.CpuStream``) and the
    # profiler records the thread that starts it: start and stop it there
    stream = llm.engine.runner.stream
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    stream.submit(prof.start)
    stream.record().wait()
    served = Counter(llm.engine.runner.served)
    t0 = time.perf_counter()
    n = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        n += 1
    wall = time.perf_counter() - t0
    kinds = dict(llm.engine.runner.served - served)  # NOTE: eager steps have no warmboot:: ops
    if set(kinds) != {"compiled"}:
        print(f"[moe] profile: the profiled steps were {kinds}, not all compiled", flush=True)
    stream.submit(prof.stop)
    stream.record().wait()
    wb.close()
    buckets = bucket_profile(prof.events(), args)
    buckets["host (schedule, sample, commit) and the rest"] += wall * 1e6 - sum(buckets.values())
    per_step = {k: v / 1e3 / n for k, v in buckets.items()}
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    inside = {k: round(v / 1e3 / n, 4) for k, v in fused_experts_ops(prof.events()).items()}
    report["profile"] = {
        "steps": n,
        "ms_per_step": wall * 1e3 / n,
        "step_kinds": kinds,
        "buckets_ms": per_step,
        "top_ops": top,
        "fused_experts_ops_ms": inside,
        "run": report["run"],
    }
    print(top)
    print("under warmboot::fused_experts (self ms per step):", json.dumps(inside, indent=1))
    print(json.dumps({k: round(v, 3) for k, v in per_step.items()}, indent=1), flush=True)


def bucket_profile(events, args) -> dict[str, float]:
    """Self CPU µs of every op, by the bucket its nearest marked ancestor (or itself) picks."""
    out = dict.fromkeys(BUCKETS, 0.0)
    experts, vocab = args.experts["num_experts"], args.attn["vocab_size"]
    for ev in events:
        chain = []
        node = ev
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        out[pick_bucket(ev, chain, experts, vocab)] += ev.self_cpu_time_total
    return out


def fused_experts_ops(events) -> dict[str, float]:
    """Self CPU µs by op name of the ops run inside ``warmboot::fused_experts`` (and it)."""
    out: Counter[str] = Counter()
    for ev in events:
        node = ev
        while node is not None and node.name != "warmboot::fused_experts":
            node = node.cpu_parent
        if node is not None:
            out[ev.name] += ev.self_cpu_time_total
    return dict(out.most_common())


def pick_bucket(ev, chain: list[str], experts: int, vocab: int) -> str:
    name = ev.name
    if "warmboot::fused_experts" in chain:
        if name == "warmboot::fused_experts":
            return "fused_experts (Python loop)"
        inner = chain[: chain.index("warmboot::fused_experts")]  # ev and its callers inside
        if any(n in EXPERT_GEMM_OPS for n in inner):
            return "expert GEMMs"  # NOTE: with what the GEMM op runs (its allocs, reshapes)
        if any(n in ACTIVATION_OPS or n in ROUTING_WEIGHT_OPS for n in inner):
            return "expert activation, routing weights"
        return "sort / gather / scatter"
    if "warmboot::paged_attention" in chain:
        return "attention"
    if "warmboot::packed_linear" in chain:
        packed = next(
            (e for e in [ev, *_ancestors(ev)] if e.name == "warmboot::packed_linear"), None
        )
        out_features = _out_features(packed)
        if out_features == experts:
            return "router GEMM"
        if out_features == vocab:
            return "LM head"
        return "other GEMMs (q/k/v, o)"
    if any("Compiled" in c or "inductor" in c.lower() or "cpp_fused" in c for c in chain):
        return "compiled graph (norms, rope, router softmax/top-k, residuals)"
    return "host (schedule, sample, commit) and the rest"


def _ancestors(ev):
    node = ev.cpu_parent
    while node is not None:
        yield node
        node = node.cpu_parent


def _out_features(ev) -> int | None:
    if ev is None:
        return None
    # NOTE: packed_linear(x, layer, slot, out_features)
    inputs = getattr(ev, "concrete_inputs", None) or []
    return inputs[3] if len(inputs) > 3 and isinstance(inputs[3], int) else None
