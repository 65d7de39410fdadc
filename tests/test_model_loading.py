"""What a checkpoint may hold: every tensor is read or refused by name; quantizations not
served, adapters, pickles and unknown architectures are refused saying why (and
``warmboot serve`` exits non-zero for them); a config without ``architectures`` resolves
from ``model_type``; rope tables follow ``max_model_len``; a family restores from a snapshot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import hf_greedy, random_prompts
from tests.tiny_models import VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelFilesError

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _copy(path: Path, tmp_path: Path, name: str = "model") -> Path:
    out = tmp_path / name
    shutil.copytree(path, out)
    return out


def _edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
    (model / "config.json").write_text(json.dumps(cfg))


def _add_tensor(model: Path, name: str, tensor: torch.Tensor) -> None:
    weights = load_file(model / "model.safetensors")
    weights[name] = tensor
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), max_model_len=64, block_size=4, num_kv_blocks=32, **kw)


def test_an_unread_tensor_is_refused_by_name(path, tmp_path):
    """A Llama with MLP biases in the file but ``mlp_bias`` false would answer wrongly."""
    bad = _copy(path, tmp_path)
    _add_tensor(bad, "model.layers.1.mlp.down_proj.bias", torch.randn(72))
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.down_proj\.bias"):
        _llm(bad)


def test_stored_rope_buffers_are_ignored_by_design(path, tmp_path, hf):
    ok = _copy(path, tmp_path)
    _add_tensor(ok, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.randn(6))
    prompt = random_prompts([9], VOCAB_SIZE, seed=4)[0]
    out = _llm(ok).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)


W8A8 = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "symmetric": False},
    "format": "int-quantized",
}


@pytest.mark.parametrize(
    "quant, match",
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            r"quantization_config.activation_scheme = 'static' is not served \(dynamic\)",
        ),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'.*not served"),
        ({"quant_method": "modelopt"}, "quant_method 'modelopt' .ModelOpt FP8/NVFP4"),
        ({"quant_method": "gptq", "bits": 3}, r"quantization_config.bits = 3 is not served"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version = 'gemv'"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"group_0": W8A8}},
            r"config_groups.group_0.input_activations.symmetric = False is not served",
        ),
    ],
)
def test_a_quantization_that_is_not_served_is_refused_by_name(quant, match, path, tmp_path):
    bad = _copy(path, tmp_path)
    _edit_config(bad, quantization_config=quant)
    with pytest.raises(UnsupportedModelError, match=match):
        _llm(bad)


def test_an_autogptq_quantize_config_over_dense_weights_is_refused(path, tmp_path):
    bad = _copy(path, tmp_path)
    (bad / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(UnsupportedModelError, match="config says gptq W4A16 g128.*no linear"):
        _llm(bad)


def test_fp8_weights_are_refused(path, tmp_path):
    bad = _copy(path, tmp_path)
    weights = load_file(bad / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=f"{name} is float8_e4m3fn"):
        _llm(bad)


def test_adapter_files_are_refused(path, tmp_path):
    bad = _copy(path, tmp_path)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(UnsupportedModelError, match="adapter_config.json.*not supported"):
        _llm(bad)


def test_a_pickle_checkpoint_is_refused_unread(path, tmp_path):
    bad = _copy(path, tmp_path)
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin is a pickle"):
        _llm(bad)


def test_a_config_without_architectures_resolves_from_model_type(
    tmp_path, tiny_model_dir, hf_model
):
    src = tiny_model_dir("qwen3")
    model = _copy(src, tmp_path)
    _edit_config(model, architectures=None)
    llm = _llm(model)
    assert llm.engine.model_config.architecture == "Qwen3ForCausalLM"
    prompt = random_prompts([11], VOCAB_SIZE, seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(src), prompt, 8)


def test_rope_tables_follow_max_model_len(path, tmp_path):
    """A 1M-position config costs nothing more than its context."""
    big = _copy(path, tmp_path)
    _edit_config(big, max_position_embeddings=1 << 20)
    llm = _llm(big)
    (rope,) = llm.engine.runner.model.rotary_embeddings()
    assert rope.cos.shape[0] == 64


def _serve(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "warmboot.cli", "serve", "--model", str(model), "--port", "0"]
    cmd += ["--sandbox", "none", "--enforce-eager"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("problem", ["missing", "architecture", "quantized", "unread_tensor"])
def test_serve_exits_nonzero_with_the_reason(problem, path, tmp_path):
    """Refusals found before the engine starts (the first three) and while it loads (the
    last) both end the server with exit status 2 and a one-line reason."""
    model = tmp_path / "nowhere" if problem == "missing" else _copy(path, tmp_path)
    expected = {
        "missing": "does not exist",
        "architecture": "unsupported architecture .'GPT2LMHeadModel'",
        "quantized": "quant_method 'bitsandbytes'",
        "unread_tensor": r"layers\.0\.mlp\.up_proj\.bias",
    }[problem]
    if problem == "architecture":
        _edit_config(model, architectures=["GPT2LMHeadModel"])
    elif problem == "quantized":
        _edit_config(model, quantization_config={"quant_method": "bitsandbytes"})
    elif problem == "unread_tensor":
        _add_tensor(model, "model.layers.0.mlp.up_proj.bias", torch.randn(100))
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    import re

    assert re.search(f"error: cannot serve .*{expected}", done.stderr), done.stderr[-2000:]


def test_a_family_restores_from_a_snapshot(tmp_path, tiny_model_dir):
    """Tier A: the compatibility key names the model class; the restore answers the same."""
    path, store = tiny_model_dir("granite"), tmp_path / "store"
    prompts = [{"prompt_token_ids": p} for p in random_prompts([13, 30], VOCAB_SIZE, seed=6)]
    cold = _llm(path, snapshot_store=str(store))
    assert cold.engine.start_info.path == "cold"
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]
    del cold
    (manifest,) = (store / "manifests").glob("*.json")
    assert "granite.GraniteForCausalLM" in manifest.read_text()
    warm = _llm(path, snapshot_store=str(store))
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info.reason
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == expected


def test_a_missing_file_is_a_files_error(tmp_path):
    from warmboot.models.checkpoint import preflight

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="lacks 'num_attention_heads'"):
        preflight(tmp_path)
    with pytest.raises(ModelFilesError, match="does not exist"):
        preflight(tmp_path / "absent")


def test_harmless_buffers_of_any_dtype_are_not_read(tmp_path, tiny_model_dir, hf_model):
    """Pythia checkpoints store a bool causal mask per layer (``attention.bias``): listed as
    harmless by the family, it is skipped unread (its dtype alone would be refused)."""
    src = tiny_model_dir("gpt_neox")
    model = _copy(src, tmp_path)
    _add_tensor(model, "gpt_neox.layers.0.attention.bias", torch.ones(1, 1, 8, 8, dtype=torch.bool))
    prompt = random_prompts([10], VOCAB_SIZE, seed=8)[0]
    out = _llm(model).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(src), prompt, 8)
