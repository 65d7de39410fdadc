"""A tiny GPT-OSS checkpoint whose experts are MXFP4, as the GPT-OSS release stores them:
``{proj}_blocks`` uint8 ``(E, out, in/32, 16)`` (two e2m1 values a byte, input ``2j`` in the
low nibble), ``{proj}_scales`` uint8 ``(E, out, in/32)`` (e8m0 exponents, scale
``2^(e - 127)``), ``out`` the dense tensor's last dim (``gate_up_proj``'s gate and up
interleaved) and ``in`` its middle one; attention, router, embeddings and head dense
(``modules_to_not_convert``). transformers reads the directory itself (on the CPU it
dequantizes the experts on load): it is the reference.

Each block of 32 is rounded to the nearest e2m1 value under the smallest power-of-two scale that fits its largest magnitude under 6, a few blocks forced to
extreme exponents and every code present.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests import tiny_models
from tests.family_specs.gpt_oss import SPECS
from tests.tiny_models import _COMMON, _perturb, _tokenizer_dir

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SPEC = SPECS["gpt_oss"][1] | dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2)
"""The family's tiny GPT-OSS with MXFP4's 32-input blocks along both experts' inputs."""
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]


def write_gpt_oss_mxfp4(out: Path, seed: int = 0, spec: dict | None = None) -> Path:
    """The tiny GPT-OSS (or one of config ``spec``) with MXFP4 experts in ``out``; its dense
    bf16 original beside it (``out-dense``)."""
    dense = out.with_name(out.name + "-dense")
    make_dense(dense, spec or SPEC)
    tensors = load_file(str(dense / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).float()  # NOTE: (E, out, in)
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(w, gen)
    out.mkdir(parents=True, exist_ok=True)
    for f in dense.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_dense(out: Path, spec: dict) -> Path:
    import transformers

    config = transformers.GptOssConfig(**(_COMMON | spec))
    torch.manual_seed(tiny_models.SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _perturb(model)
    model.eval().save_pretrained(out)
    tok = _tokenizer_dir(tiny_models.VOCAB_SIZE)
    for name in tiny_models.TOKENIZER_FILES:
        shutil.copyfile(tok / name, out / name)
    return out


def quantize(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E, out, in)`` -> MXFP4 blocks and scales."""
    blocks = w.double().unflatten(-1, (-1, 32))  # (E, out, G, 32)
    amax = blocks.abs().amax(-1).clamp_min(2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    wild = torch.rand(exp.shape, generator=gen) < 0.05  # NOTE: scales far from 1
    exp = torch.where(wild, torch.randint(-40, 30, exp.shape, generator=gen).double(), exp)
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    codes = nearest_e2m1(scaled)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)  # NOTE: every code, -0 too
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """An e2m1 code nearest each value (clamped to +-6; the file's codes are the truth, so
    a tie may go either way)."""
    code = (x.abs().clamp(max=6.0).unsqueeze(-1) - E2M1.double()).abs().argmin(-1)
    return code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
