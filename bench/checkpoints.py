"""The checkpoints and prompts the benchmarks build: random Llamas of a given shape (a fresh
temporary folder each), the larger models built once under the warmboot cache (the design
page's 0.49B Llama, a Qwen2.5-1.5B-shaped model), random prompts. Random weights, a tokenizer
trained on the vocabulary."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BIG_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
BIG_NAME = "bench-llama-0.49b"
QWEN_1_5B_SHAPE = dict(  # Qwen2.5-1.5B's shape (1.54B parameters), random weights
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN_1_5B_NAME = "bench-qwen2-1.5b"


def random_llama(prefix: str, shape: dict, dtype: str = "float32", **kw) -> Path:
    """A random Llama of ``shape`` (seed 0) with its tokenizer, in a new temporary folder."""
    from warmboot.models.demo import write_random_llama
    from warmboot.tokenizer.train import train_tokenizer

    model = Path(tempfile.mkdtemp(prefix=prefix)) / "model"
    write_random_llama(model, **shape, seed=0, dtype=dtype, **kw)
    train_tokenizer(model, shape["vocab_size"])
    return model


def prompts_for(batch: int, length: int, vocab: int, seed: int, mixed: bool = False):
    """``batch`` random prompts of ``length`` tokens, or (mixed) of lengths spread evenly
    over [length / 8, 2 * length - length / 8] (same mean)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lo = length // 8
    lengths = [lo + (2 * (length - lo) * i) // max(1, batch - 1) for i in range(batch)]
    lengths = lengths if mixed else [length] * batch
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def big_model() -> Path:
    """The design page's 0.49B Llama (random, bf16, one model.safetensors), built once."""
    return _built_model(BIG_NAME, "LlamaConfig", "LlamaForCausalLM", BIG_SHAPE)


def qwen_1_5b() -> Path:
    """A model of Qwen2.5-1.5B's shape (random, bf16), built once."""
    return _built_model(QWEN_1_5B_NAME, "Qwen2Config", "Qwen2ForCausalLM", QWEN_1_5B_SHAPE)


def _built_model(name: str, config_cls: str, model_cls: str, shape: dict) -> Path:
    from warmboot.models.demo import cache_root

    path = cache_root() / "models" / name
    if any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file():
        return path
    import torch
    import transformers

    from warmboot.tokenizer.train import train_tokenizer

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = getattr(transformers, config_cls)(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(tmp)
    train_tokenizer(tmp, min(shape["vocab_size"], 32000))
    os.replace(tmp, path)
    return path
