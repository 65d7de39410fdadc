"""Tiny real peft LoRA adapters, written by peft 0.21 itself, and what peft makes of them.

peft and accelerate come from ``tests/lora/requirements.txt`` installed beside the project venv
(``.venv-lora/site``, or ``$WARMBOOT_LORA_SITE``); ``import_peft`` puts that directory on
``sys.path`` the first time it is needed. peft initialises ``lora_B`` to zeros (an adapter that
changes nothing); ``make_adapter`` gives both factors noise before saving.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LORA_SITE = Path(os.environ.get("WARMBOOT_LORA_SITE", ROOT / ".venv-lora/site"))
INSTALL = (
    ".venv/bin/python -m pip install --no-deps --target .venv-lora/site "
    "-r tests/lora/requirements.txt  (or: make .venv-lora/.installed)"
)
SEED = 4321
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peft_missing() -> str | None:
    """Why peft cannot be imported here (a skip reason), or None."""
    if not (LORA_SITE / "peft").is_dir():
        return f"peft 0.21 is not in {LORA_SITE}: {INSTALL}"
    return None


def import_peft():
    """The peft module, from ``LORA_SITE`` (added to ``sys.path`` once)."""
    reason = peft_missing()
    if reason:
        raise RuntimeError(reason)
    if str(LORA_SITE) not in sys.path:
        sys.path.append(str(LORA_SITE))
    import peft

    return peft


def tiny_llama(seed: int = SEED) -> torch.nn.Module:
    """A small random float32 Llama built from its config (the base the adapters target)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _base(base) -> torch.nn.Module:
    if base is None:
        return tiny_llama()
    if isinstance(base, (str, Path)):
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return copy.deepcopy(base)


def make_adapter(
    out_dir: str | Path,
    base=None,
    *,
    r: int = 4,
    alpha: float = 8,
    rslora: bool = False,
    target_modules=("q_proj", "v_proj"),
    dtype: str = "float32",
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    seed: int = 0,
    std: float = 0.1,
    safe_serialization: bool = True,
    **config,
) -> Path:
    """Write a peft LoRA adapter for ``base`` (None: ``tiny_llama()``; a model directory; or a
    model, copied) into ``out_dir``; factors random (A ~ N(0, 1/in), B ~ N(0, std^2)) and saved
    in ``dtype``. Other ``LoraConfig`` fields pass through ``config``."""
    peft = import_peft()
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    lora_config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        **config,
    )
    model = peft.get_peft_model(_base(base), lora_config)
    randomize(model, seed, std)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(DTYPES[dtype])
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Noise in every LoRA factor of a peft model (peft's lora_B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if ".lora_A." in name or "lora_embedding_A" in name:
            fan_in = param.shape[1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
        elif ".lora_B." in name or "lora_embedding_B" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def make_ia3_adapter(out_dir: str | Path, base=None) -> Path:
    """A peft IA3 adapter (a peft_type other than LORA)."""
    peft = import_peft()
    config = peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    model = peft.get_peft_model(_base(base), config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def peft_factors(
    adapter_dir: str | Path, base=None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What peft holds once it loads ``adapter_dir`` onto a float32 ``base``: module name ->
    (lora_A weight, lora_B weight * scaling), both float32."""
    peft = import_peft()
    from peft.tuners.lora import LoraLayer

    model = peft.PeftModel.from_pretrained(_base(base), str(adapter_dir))
    out = {}
    prefix = "base_model.model."
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            a = module.lora_A["default"].weight.detach().to(torch.float32)
            b = module.lora_B["default"].weight.detach().to(torch.float32)
            out[name.removeprefix(prefix)] = (a, b * module.scaling["default"])
    return out
