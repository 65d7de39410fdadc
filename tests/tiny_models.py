"""Tiny random HF checkpoints (built with ``transformers``) for correctness tests.

Sizes are odd on purpose. Weights are larger than HF's default init (std ``INIT_STD``, norm
weights in [0.5, 1.5], non-zero biases) so greedy decoding has clear top-2 logit margins.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from tests.family_specs import all_specs
from warmboot.tokenizer.train import train_tokenizer

VOCAB_SIZE = 512
SEED = 1234
INIT_STD = 0.2
KINDS = ("llama", "llama_tied_mqa", "qwen2", "qwen3", "mistral")
"""The original four families, tested in depth (``test_engine_vs_hf``); every other family
is in ``tests/family_specs`` (``FAMILY_KINDS``, ``test_families``)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    initializer_range=INIT_STD,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_SPECS: dict[str, tuple[str, dict]] = {
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=72,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=100,
            tie_word_embeddings=False,
            rope_scaling=_LLAMA3_ROPE,
        ),
    ),
    "llama_tied_mqa": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=112,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=80,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            sliding_window=12,
            tie_word_embeddings=False,
        ),
    ),
}


_SPECS.update(all_specs())
FAMILY_KINDS = tuple(k for k in _SPECS if k not in KINDS)


def make_tiny_model(
    kind: str, out_dir: Path, dtype: str = "float32", attn_implementation: str = "eager"
) -> Path:
    """Save a tiny random ``kind`` model (one of ``KINDS``) plus a 512-token tokenizer in out_dir."""
    import transformers

    if kind not in _SPECS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {sorted(_SPECS)}")
    config_cls, spec = _SPECS[kind]
    config = getattr(transformers, config_cls)(**(_COMMON | spec))
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    )
    _perturb(model)
    model = model.to(getattr(torch, dtype)).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tok_dir = _tokenizer_dir(VOCAB_SIZE)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out_dir / name)
    return out_dir


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Non-trivial norm weights and biases (HF inits them to ones and zeros)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith("correct_output_scale"):  # NOTE: Gemma 3n: zeros
            param.copy_(0.5 + torch.rand(param.shape, generator=gen))
        elif name.endswith((".bias", "_proj_bias")):  # NOTE: GPT-OSS's experts' biases
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        elif name.endswith(("e_score_correction_bias", "gate_bias")):  # NOTE: HF inits zeros
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        elif name.endswith(("router.scale", "per_expert_scale")):  # NOTE: Gemma 4: ones
            param.copy_(0.5 + torch.rand(param.shape, generator=gen))
        elif name.endswith("z_L_init"):  # NOTE: HRM-Text's, zeros
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    for name, buf in model.named_buffers():  # NOTE: most families keep that bias as a buffer
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
        elif name.endswith("layer_scalar"):  # NOTE: Gemma 4's, ones
            buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))
    if getattr(model.config, "model_type", None) == "deepseek_v4":
        _perturb_v4(model, gen)


@torch.no_grad()
def _perturb_v4(model: torch.nn.Module, gen: torch.Generator) -> None:
    """DeepSeek-V4's zero-initialised sinks, window biases and hyper-connection biases
    random; its hash table (zeros: expert 0 for every token) random expert ids; the pad
    token's embedding row (zeros) too: a zero query scores every compressed entry 0, a tie
    torch.topk breaks in no documented order (ours: the earlier entry)."""
    model.get_input_embeddings().weight[0].normal_(0.0, 0.2, generator=gen)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("sinks", "position_bias", "hc.base", "hc_base")):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
        elif name.endswith("tid2eid"):
            t.copy_(torch.randint(0, model.config.n_routed_experts, t.shape, generator=gen))


@functools.cache
def _tokenizer_dir(vocab_size: int) -> Path:
    """Train the tokenizer once per process into a temporary directory."""
    path = Path(tempfile.mkdtemp(prefix=f"warmboot-tok{vocab_size}-"))
    atexit.register(shutil.rmtree, path, True)
    train_tokenizer(path, vocab_size)
    return path
