"""``bench.moe``'s checkpoints: the MoE and its dense twins (random, bf16, built once under the
cache), their parameter and byte counts, and the ``mla`` section's models and KV figures."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.checkpoints import prompts_for
from bench.common import ROOT

MODELS = ("moe", "active", "total")
COMMON = dict(
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    rope_theta=10000.0,
)
MLA = dict(  # DeepSeek-V3's attention scaled to hidden 1024 (its ranks and head dims kept)
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)
CONTEXT_4K = 4096
POOL_BYTES = 2 << 30
"""The KV pool the ``mla`` section gives each model (anonymous memory: costs nothing unused)."""


# --- checkpoints ----------------------------------------------------------------------------


def model_configs(attn: dict, experts: dict, family: str = "qwen3") -> dict[str, dict]:
    """name -> (config class, kwargs): the MoE and its active / total dense twins."""
    k, i, e = (experts[n] for n in ("num_experts_per_tok", "moe_intermediate_size", "num_experts"))
    base = COMMON | attn
    if family == "mixtral":
        moe = (
            "MixtralConfig",
            base | dict(num_local_experts=e, num_experts_per_tok=k, intermediate_size=i),
        )
    else:
        moe = (
            "Qwen3MoeConfig",
            base | experts | dict(norm_topk_prob=True, intermediate_size=k * i),
        )
    return {
        "moe": moe,
        "active": ("Qwen3Config", base | dict(intermediate_size=k * i)),
        "total": ("Qwen3Config", base | dict(intermediate_size=e * i)),
    }


def ensure_models(
    attn: dict, experts: dict, family: str = "qwen3", names: tuple[str, ...] = MODELS
) -> dict[str, Path]:
    """The checkpoints, built once under the cache (a key of their configs names the folder)."""
    from warmboot.config import cache_root

    configs = model_configs(attn, experts, family)
    key = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_root() / "bench-moe" / f"{family}-{key}"
    paths = {}
    for name in names:
        cls, kw = configs[name]
        path = root / name
        if not (path / ".complete").exists():
            build_checkpoint(cls, kw, path)
        paths[name] = path
    return paths


def build_checkpoint(config_cls: str, kw: dict, path: Path) -> None:
    """``from_config`` -> bf16 -> ``save_pretrained``, plus the tokenizer; in a child process,
    so the fp32 init's memory goes back before the engines start."""
    code = (
        "import json, sys, torch, transformers\n"
        "cls, kw, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]\n"
        "torch.manual_seed(0)\n"
        "config = getattr(transformers, cls)(**kw)\n"
        "model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)\n"
        "model.save_pretrained(out)\n"
    )
    if path.exists():
        shutil.rmtree(path)
    print(f"[moe] building {config_cls} -> {path}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", code, config_cls, json.dumps(kw), str(path)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    from warmboot.tokenizer.train import train_tokenizer

    train_tokenizer(path, kw["vocab_size"])
    (path / ".complete").write_text("ok\n")


def param_facts(attn: dict, experts: dict) -> dict[str, dict]:
    """Parameters (total, touched per token) and bf16 bytes a decode step reads at batch 1,
    per model; the MoE's expected distinct experts per layer at each batch (uniform routing)."""
    h, layers, v = attn["hidden_size"], attn["num_hidden_layers"], attn["vocab_size"]
    q, kv = (
        attn["num_attention_heads"] * attn["head_dim"],
        attn["num_key_value_heads"] * attn["head_dim"],
    )
    e, k, i = (experts[n] for n in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
    attention = 2 * h * q + 2 * h * kv + 2 * attn["head_dim"] + 2 * h  # q/k/v/o, q/k norms, norms
    head = v * h  # the LM head (untied); the embedding row one token reads is negligible
    out = {}
    for name, mlp_total, mlp_active in (
        ("moe", h * e + e * 3 * h * i, h * e + k * 3 * h * i),
        ("active", 3 * h * k * i, 3 * h * k * i),
        ("total", 3 * h * e * i, 3 * h * e * i),
    ):
        total = layers * (attention + mlp_total) + 2 * v * h + h
        touched = layers * (attention + mlp_active) + head + h
        out[name] = {
            "params": total,
            "params_per_token": touched,
            "bf16_bytes_per_token": 2 * touched,
        }
    out["moe"]["experts_per_layer_at_batch"] = {
        str(b): round(e * (1 - (1 - k / e) ** b), 1) for b in (1, 8, 32)
    }
    return out


# --- MLA --------------------------------------------------------------------------------------


def mla_section(args, report: dict) -> None:
    """KV bytes per token of a DeepSeek-V3 (MLA) against MHA / GQA models of the same width
    (the engine's ``stats()``), and 4k-token sequences per ``POOL_BYTES`` pool."""
    from warmboot.architectures import ARCHITECTURES

    served = "DeepseekV3ForCausalLM" in ARCHITECTURES
    info: dict = {"served": served, "run": report["run"]}
    report["mla"] = info
    if not served:
        info["todo"] = "DeepseekV3ForCausalLM is not in warmboot/models/registry.py yet"
        return
    attn = args.attn
    h, heads, layers = attn["hidden_size"], attn["num_attention_heads"], attn["num_hidden_layers"]
    base = COMMON | dict(
        vocab_size=attn["vocab_size"],
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
    )
    mla_kw = base | (MLA if not args.quick else dict(MLA, kv_lora_rank=128, q_lora_rank=96))
    mla_kw |= dict(
        num_key_value_heads=heads,
        intermediate_size=4 * h,
        first_k_dense_replace=1,
        n_routed_experts=args.experts["num_experts"],
        n_shared_experts=1,
        num_experts_per_tok=args.experts["num_experts_per_tok"],
        moe_intermediate_size=args.experts["moe_intermediate_size"],
        n_group=1,
        topk_group=1,
    )
    dense = base | dict(intermediate_size=4 * h, head_dim=h // heads)
    specs = {
        "MLA (DeepseekV3)": ("DeepseekV3Config", mla_kw),
        f"MHA ({heads} KV heads x {h // heads})": (
            "Qwen3Config",
            dense | dict(num_key_value_heads=heads),
        ),
        f"GQA ({attn['num_key_value_heads']} KV heads x {h // heads}, the MoE's)": (
            "Qwen3Config",
            dense | dict(num_key_value_heads=attn["num_key_value_heads"]),
        ),
    }
    key = hashlib.sha256(json.dumps(specs, sort_keys=True).encode()).hexdigest()[:12]
    from warmboot.config import cache_root

    root = cache_root() / "bench-moe" / f"mla-{key}"
    rows = []
    for i, (label, (cls, kw)) in enumerate(specs.items()):
        path = root / f"{i}-{cls}"
        if not (path / ".complete").exists():
            build_checkpoint(cls, kw, path)
        rows.append(kv_row(label, path, args))
    info["rows"] = rows
    info["config"] = {k: mla_kw[k] for k in MLA}
    full = heads * (mla_kw["qk_nope_head_dim"] + mla_kw["qk_rope_head_dim"] + mla_kw["v_head_dim"])
    info["unabsorbed_kv_bytes_per_token"] = 2 * layers * full  # bf16: full K and V per head


def kv_row(label: str, path: Path, args) -> dict:
    from warmboot import LLM, SamplingParams

    row: dict = {"model": label}
    try:
        llm = LLM(
            str(path),
            dtype="bfloat16",
            max_model_len=CONTEXT_4K + 64,
            max_num_seqs=8,
            kv_cache_memory_bytes=POOL_BYTES,
            enforce_eager=True,
        )
        stats = llm.stats()
        out = llm.generate(
            [{"prompt_token_ids": prompts_for(1, 32, args.attn["vocab_size"], 3)[0]}],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    except Exception as e:  # NOTE: a family being added may not boot yet; report, not fail
        row["error"] = f"{type(e).__name__}: {e}"[-2000:]
        print(f"[moe] {label}: {row['error']}", flush=True)
        return row
    block = llm.engine.runner.block_size if hasattr(llm.engine, "runner") else 16
    per_seq = math.ceil(CONTEXT_4K / block)
    row |= {
        "kv_bytes_per_token": stats["kv_bytes_per_token"],
        "kv_blocks": stats["kv_blocks_total"],
        "block_size": block,
        "seqs_4k": stats["kv_blocks_total"] // per_seq,
        "decoded": len(out[0].outputs[0].token_ids),
    }
    print(f"[moe] {row}", flush=True)
    return row
