"""The random demo Llama writer, the default-model cache, and the tiny test checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import KINDS, make_tiny_model
from warmboot.models import demo

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


@pytest.mark.parametrize(("tied", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_write_random_llama_loads_in_transformers(tmp_path, tied, dtype):
    demo.write_random_llama(tmp_path, **SMALL, tie_word_embeddings=tied, seed=3, dtype=dtype)
    weights = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in weights) is not tied
    assert all(t.dtype == getattr(torch, dtype) for t in weights.values())
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    state = model.state_dict()
    assert set(state) - set(weights) == ({"lm_head.weight"} if tied else set())
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    if tied:
        assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert model.dtype == getattr(torch, dtype)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_random_weights_init_and_determinism(tmp_path):
    for sub in ("a", "b"):
        demo.write_random_llama(
            tmp_path / sub, **SMALL, tie_word_embeddings=True, seed=0, dtype="float32"
        )
    a, b = (tmp_path / "a/model.safetensors", tmp_path / "b/model.safetensors")
    assert a.read_bytes() == b.read_bytes()
    weights = load_file(a)
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    std = weights["model.embed_tokens.weight"].std().item()
    assert abs(std - demo.INITIALIZER_RANGE) < 0.002
    gen = json.loads((tmp_path / "a/generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["bos_token_id"] == 0


def test_default_config_parses_in_transformers(tmp_path):
    config = demo.llama_config(dtype="bfloat16", **demo.DEFAULT_SHAPE)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.LlamaConfig.from_pretrained(tmp_path)
    expected = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
        hidden_act="silu",
    )
    assert {k: getattr(hf, k) for k in expected} == expected
    assert hf.architectures == ["LlamaForCausalLM"] and hf.model_type == "llama"
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == 10000.0
    assert hf.dtype == torch.bfloat16
    n_params = sum(torch.Size(s).numel() for s in demo.llama_weight_shapes(config).values())
    assert n_params == 134_515_008  # SmolLM-135M


def test_cache_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path))
    assert demo.cache_root() == tmp_path
    assert demo.default_model_dir() == tmp_path / "models" / demo.DEFAULT_MODEL_NAME
    monkeypatch.delenv("WARMBOOT_CACHE")
    assert demo.cache_root() == demo.Path.home() / ".cache" / "warmboot"


@pytest.fixture
def small_default(monkeypatch):
    """Make ensure_default_model build a small model so the test is quick."""
    monkeypatch.setattr(demo, "DEFAULT_SHAPE", {**SMALL, "tie_word_embeddings": True})


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ensure_default_model_atomic(tmp_path, small_default, monkeypatch):
    target = tmp_path / "models" / "demo"
    target.parent.mkdir(parents=True)
    stale = target.parent / f".tmp-demo-{_dead_pid()}-abc"
    live = target.parent / f".tmp-demo-{os.getpid()}-xyz"
    for d in (stale, live):
        d.mkdir()
        (d / "config.json").write_text("{}")
    target.mkdir()  # a half-written directory is not used
    (target / "config.json").write_text("{}")

    assert demo.ensure_default_model(target) == target
    assert not stale.exists() and live.exists()
    assert all((target / f).is_file() for f in demo.REQUIRED_FILES)
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["demo", live.name])
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 64
    transformers.AutoTokenizer.from_pretrained(target)

    def fail(*args, **kwargs):
        raise AssertionError("must not rebuild an existing model")

    monkeypatch.setattr(demo, "write_random_llama", fail)
    assert demo.ensure_default_model(target) == target


def test_ensure_default_model_failure_leaves_nothing(tmp_path, small_default, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("warmboot.tokenizer.train.train_tokenizer", boom)
    monkeypatch.setenv("WARMBOOT_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="disk full"):
        demo.ensure_default_model()
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
def test_default_model_end_to_end(tmp_path):
    path = demo.ensure_default_model(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size == 49152
    assert model.dtype == torch.bfloat16
    ids = tok("Hello café 東京", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_load_and_generate(kind, tmp_path):
    make_tiny_model(kind, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == model.config.vocab_size == 512
    ids = torch.tensor([list(range(10, 30))])
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, 25)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(not torch.equal(p, torch.ones_like(p)) for p in norms)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    if kind == "mistral":
        assert model.config.sliding_window == 12
    if kind == "qwen3":
        assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size


def test_tiny_model_bf16(tmp_path):
    make_tiny_model("llama", tmp_path, dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert torch.isfinite(logits).all()
