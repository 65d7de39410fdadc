"""``warmboot.lora.adapter``: peft adapters read back to exactly what peft 0.21 holds.

Adapters are written by peft itself (``tests/lora_adapters``); the reference is peft's own
``PeftModel.from_pretrained`` on the same kind of base: per module, lora_A and lora_B times
peft's scaling, in float32, must equal the loader's ``a`` and ``b`` bit for bit. Tests that
need peft skip, saying how to install it, when ``.venv-lora/site`` is absent.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import lora_adapters
from warmboot.lora.adapter import LoraError, load_adapter

MAX_RANK = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = "adapter_model.safetensors"

needs_peft = pytest.mark.skipif(
    lora_adapters.peft_missing() is not None, reason=str(lora_adapters.peft_missing())
)

PARITY = {
    "list": dict(target_modules=LINEARS),
    "regex": dict(target_modules=r".*\.(q_proj|down_proj)"),
    "all-linear": dict(target_modules="all-linear"),
    "rslora": dict(r=8, alpha=16, rslora=True, target_modules=("q_proj", "up_proj")),
    "patterns": dict(
        target_modules=("q_proj", "k_proj", "v_proj"),
        rank_pattern={"k_proj": 6, r"layers\.1\.self_attn\.v_proj": 2},
        alpha_pattern={"v_proj": 3, "q_proj": 5},
    ),
    "layers": dict(target_modules=("q_proj", "o_proj"), layers_to_transform=[1]),
    "bf16": dict(dtype="bfloat16", target_modules=("q_proj", "down_proj")),
    "fp16": dict(dtype="float16", target_modules=("v_proj", "gate_proj")),
}
GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _names(projs, layers=(0, 1)) -> set[str]:
    return {f"model.layers.{i}.{GROUP.get(p, 'mlp')}.{p}" for i in layers for p in projs}


EXPECTED = {  # the modules each case's adapter holds
    "list": _names(LINEARS),
    "regex": _names(("q_proj", "down_proj")),
    "all-linear": _names(LINEARS),
    "rslora": _names(("q_proj", "up_proj")),
    "patterns": _names(("q_proj", "k_proj", "v_proj")),
    "layers": _names(("q_proj", "o_proj"), layers=(1,)),
    "bf16": _names(("q_proj", "down_proj")),
    "fp16": _names(("v_proj", "gate_proj")),
}


@needs_peft
@pytest.mark.parametrize("case", sorted(PARITY))
def test_matches_peft(tmp_path, case):
    path = lora_adapters.make_adapter(tmp_path / case, **PARITY[case])
    adapter = load_adapter(path, MAX_RANK)
    reference = lora_adapters.peft_factors(path)
    assert set(adapter.modules) == set(reference) == EXPECTED[case]
    for name, (a, b) in reference.items():
        module = adapter.modules[name]
        assert module.a.dtype == module.b.dtype == torch.float32
        assert torch.equal(module.a, a), name
        assert torch.equal(module.b, b), name
    assert adapter.rank == max(a.shape[0] for a, _ in reference.values())
    assert adapter.path == path


@needs_peft
def test_scaling_is_not_trivial(tmp_path):
    """The cases above would not see a missing scaling if it were 1: here it is 2 and, with
    rsLoRA, 16 / sqrt(8); the file's lora_B times it is what comes back."""
    for kw, scaling in ((dict(r=4, alpha=8), 2.0), (dict(r=8, alpha=16, rslora=True), 16 / 8**0.5)):
        path = lora_adapters.make_adapter(tmp_path / str(scaling), **kw)
        raw = load_file(path / WEIGHTS)
        adapter = load_adapter(path, MAX_RANK)
        name = "model.layers.0.self_attn.q_proj"
        b = raw[f"base_model.model.{name}.lora_B.weight"]
        assert torch.equal(adapter.modules[name].b, b * scaling)
        assert not torch.equal(adapter.modules[name].b, b)


@needs_peft
def test_digest(tmp_path):
    one = lora_adapters.make_adapter(tmp_path / "one")
    two = lora_adapters.make_adapter(tmp_path / "two", seed=1)
    data = (one / "adapter_config.json").read_bytes() + (one / WEIGHTS).read_bytes()
    assert load_adapter(one, MAX_RANK).digest == hashlib.sha256(data).hexdigest()
    assert load_adapter(one, MAX_RANK).digest != load_adapter(two, MAX_RANK).digest


def test_hand_written_adapter(tmp_path):
    """Without peft: a hand-written fp16 adapter, rank_pattern by regex, scaling alpha / r."""
    gen = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(4, 8, generator=gen), torch.randn(6, 4, generator=gen)
    a1, b1 = torch.randn(2, 8, generator=gen), torch.randn(8, 2, generator=gen)
    tensors = {
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": a0,
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": b0,
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": a1,
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": b1,
    }
    config = dict(
        peft_type="LORA",
        r=4,
        lora_alpha=6,
        target_modules=["up_proj", "q_proj"],
        rank_pattern={r"layers\.1\..*": 2},
        alpha_pattern={"q_proj": 3},
    )
    _write(tmp_path, config, {k: v.half() for k, v in tensors.items()})
    adapter = load_adapter(tmp_path, 4)
    up, q = (
        adapter.modules["model.layers.0.mlp.up_proj"],
        adapter.modules["model.layers.1.self_attn.q_proj"],
    )
    assert torch.equal(up.a, a0.half().float()) and torch.equal(up.b, b0.half().float() * 1.5)
    assert torch.equal(q.a, a1.half().float()) and torch.equal(q.b, b1.half().float() * 1.5)
    assert adapter.rank == 4
    with pytest.raises(LoraError, match="max_lora_rank=3"):
        load_adapter(tmp_path, 3)


def _write(root: Path, config: dict, tensors: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def _edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | fields))


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
REFUSED = {  # name -> (make_adapter arguments, an edit of the written files or None, message)
    "dora": (dict(use_dora=True), None, "use_dora"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "bias_all": (dict(bias="all"), None, "bias='all'"),
    "lm_head": (dict(target_modules=["q_proj", "lm_head"]), None, "target_modules names 'lm_head'"),
    "embed_tokens": (dict(target_modules=["embed_tokens"]), None, "'embed_tokens'"),
    "lm_head_regex": (
        dict(target_modules=r".*(q_proj|lm_head)"),
        None,
        "tensor base_model.model.lm_head.",
    ),
    "embedding_tensor": (
        dict(target_modules=["embed_tokens"]),
        lambda p: _edit_config(p, target_modules=None),
        "tensor base_model.model.model.embed_tokens.",
    ),
    "rank": (dict(r=32), None, "r=32 is above max_lora_rank=16"),
    "pissa": (dict(init_lora_weights="pissa"), None, "init_lora_weights='pissa'"),
    "shape_a": (
        {},
        lambda p: _edit_tensors(p, lambda t: t.update({Q_A: t[Q_A][:3]})),
        "module model.layers.0.self_attn.q_proj: lora_A (3, 32)",
    ),
    "shape_b": (
        {},
        lambda p: _edit_tensors(p, lambda t: t.update({Q_B: t[Q_B][:, :3].contiguous()})),
        "lora_B (32, 3)",
    ),
    "missing_b": (
        {},
        lambda p: _edit_tensors(p, lambda t: t.pop(Q_B)),
        f"tensor {Q_B} is missing",
    ),
    "nan": (
        {},
        lambda p: _edit_tensors(p, lambda t: t[Q_B].view(-1).__setitem__(5, float("nan"))),
        f"tensor {Q_B} holds non-finite values",
    ),
    "inf_bf16": (
        dict(dtype="bfloat16"),
        lambda p: _edit_tensors(p, lambda t: t[Q_A].view(-1).__setitem__(0, float("inf"))),
        f"tensor {Q_A} holds non-finite values",
    ),
    "untargeted": (
        dict(target_modules=["q_proj", "v_proj"]),
        lambda p: _edit_config(p, target_modules=["q_proj"]),
        "v_proj is not in target_modules",
    ),
    "excluded": (
        dict(target_modules=["q_proj", "v_proj"]),
        lambda p: _edit_config(p, exclude_modules=["v_proj"]),
        "v_proj is excluded by exclude_modules",
    ),
    "other_layer": (
        dict(layers_to_transform=[1]),
        lambda p: _edit_config(p, layers_to_transform=[0]),
        "model.layers.1.self_attn.q_proj is not in layers_to_transform=[0]",
    ),
    "missing_weights": (
        {},
        lambda p: (p / WEIGHTS).unlink(),
        "no adapter_model.safetensors",
    ),
    "not_lora": (dict(target_modules=["q_proj"]), "ia3", "peft_type='IA3'"),
}


@needs_peft
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(tmp_path, case):
    kwargs, edit, message = REFUSED[case]
    if edit == "ia3":
        path = lora_adapters.make_ia3_adapter(tmp_path / case)
    else:
        path = lora_adapters.make_adapter(tmp_path / case, **kwargs)
        if edit is not None:
            edit(path)
    with pytest.raises(LoraError) as info:
        load_adapter(path, MAX_RANK)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value)


@needs_peft
def test_pickle_is_not_read(tmp_path, monkeypatch):
    """peft's adapter_model.bin (a pickle) is refused by name, and nothing is unpickled."""
    path = lora_adapters.make_adapter(tmp_path / "bin", safe_serialization=False)
    assert (path / "adapter_model.bin").is_file() and not (path / WEIGHTS).exists()

    def unpickle(*args, **kwargs):
        raise AssertionError("the loader unpickled")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(owner, name, unpickle)
    monkeypatch.setattr(pickle, "Unpickler", unpickle)
    with pytest.raises(LoraError, match=r"adapter_model\.bin is a pickle and is not read"):
        load_adapter(path, MAX_RANK)


def test_refused_without_peft(tmp_path):
    """Files that are not an adapter at all, and a tensor dtype outside fp32/bf16/fp16."""
    with pytest.raises(LoraError, match="not a directory"):
        load_adapter(tmp_path / "absent", MAX_RANK)
    (tmp_path / "a").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load_adapter(tmp_path / "a", MAX_RANK)
    config = dict(peft_type="LORA", r=2, lora_alpha=2, target_modules=["q_proj"])
    a = torch.zeros(2, 4, dtype=torch.float64)
    _write(tmp_path / "b", config, {Q_A: a, Q_B: torch.zeros(4, 2)})
    with pytest.raises(LoraError, match=f"tensor {Q_A}: dtype torch.float64"):
        load_adapter(tmp_path / "b", MAX_RANK)
    _write(
        tmp_path / "c",
        config | {"some_new_feature": True},
        {Q_A: a.float(), Q_B: a.T.float().contiguous()},
    )
    with pytest.raises(LoraError, match="unknown field some_new_feature=True"):
        load_adapter(tmp_path / "c", MAX_RANK)
    unprefixed = {k.removeprefix("base_model.model."): v.float() for k, v in {Q_A: a}.items()}
    _write(tmp_path / "d", config, unprefixed)
    with pytest.raises(LoraError, match="not a peft LoRA factor"):
        load_adapter(tmp_path / "d", MAX_RANK)
