"""The KV pool is allocated from the layout the model declares: an MLA model (DeepSeek) caches
one latent entry of ``kv_lora_rank + qk_rope_head_dim`` per token and layer, so a memory
budget holds proportionally more blocks than for full K/V; the cache holds exactly the
normed latent and the rotated key part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import random_prompts
from tests.tiny_models import TOKENIZER_FILES, VOCAB_SIZE
from warmboot import LLM, SamplingParams
from warmboot.kernels.backend import KVLayout
from warmboot.models.layers.mla import MLAttention

BLOCK = 4
FP32 = 4


def _llm(path, **kwargs) -> LLM:
    options = dict(max_model_len=64, block_size=BLOCK, max_num_seqs=2, enforce_eager=True)
    return LLM(str(path), **(options | kwargs))


def test_mla_pool_holds_one_latent_entry_per_token_and_layer(tiny_model_dir):
    llm = _llm(tiny_model_dir("deepseek_v3"), num_kv_blocks=20)
    runner, cfg = llm.engine.runner, llm.engine.runner.model_cfg
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    assert runner.kv_layout == KVLayout(entries=1, heads=1, dim=rank + rope)
    per_token = cfg.num_layers * (rank + rope) * FP32
    assert llm.stats()["kv_bytes_per_token"] == per_token
    assert runner.kv_bytes_per_block() == BLOCK * per_token
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache is v_cache  # one tensor: keys and values are the same entries
        assert k_cache.shape == (20 + 1, BLOCK, 1, rank + rope)  # + the scratch block
    # full K and V of the same attention would take per layer H * (nope + rope) + H * v values
    heads, nope, v = cfg.num_heads, cfg.get("qk_nope_head_dim"), cfg.get("v_head_dim")
    assert heads * (nope + rope) + heads * v > 2 * (rank + rope)


def _mha_twin(mla_dir: Path, out_dir: Path) -> Path:
    """A Llama checkpoint as wide as the MLA model (hidden size, heads, layers), with full
    multi-head K/V of ``hidden / heads`` per head."""
    import transformers

    mla = json.loads((mla_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=mla["hidden_size"],
        num_attention_heads=mla["num_attention_heads"],
        num_key_value_heads=mla["num_attention_heads"],
        num_hidden_layers=mla["num_hidden_layers"],
        intermediate_size=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(mla_dir / name, out_dir / name)
    return out_dir


def test_a_memory_budget_holds_more_mla_blocks(tiny_model_dir, tmp_path):
    """The budgeted pool divides by the model's own bytes per block: the MLA model's latent
    (48 + 16 wide per layer) against an equally wide MHA model's K and V (2 * 4 heads * 16)."""
    budget = 3 << 18  # NOTE: a multiple of both block sizes
    mla_dir = tiny_model_dir("deepseek_v3")
    mla = _llm(mla_dir, kv_cache_memory_bytes=budget)
    mha = _llm(_mha_twin(mla_dir, tmp_path / "mha"), kv_cache_memory_bytes=budget)
    blocks = {}
    for name, llm in (("mla", mla), ("mha", mha)):
        blocks[name] = llm.engine.facts.num_kv_blocks
        assert blocks[name] == budget // (BLOCK * llm.stats()["kv_bytes_per_token"])
        assert llm.stats()["kv_blocks_total"] == blocks[name]
    cfg = mla.engine.runner.model_cfg
    mla_width = cfg.get("kv_lora_rank") + cfg.get("qk_rope_head_dim")
    mha_width = 2 * cfg.num_heads * (cfg.hidden_size // cfg.num_heads)
    assert mla.stats()["kv_bytes_per_token"] == cfg.num_layers * mla_width * FP32
    assert mha.stats()["kv_bytes_per_token"] == cfg.num_layers * mha_width * FP32
    assert blocks["mla"] == blocks["mha"] * mha_width // mla_width  # here exactly 2x


@torch.no_grad()
def test_the_cache_holds_the_normed_latent_and_rotated_key(tiny_model_dir):
    """Every prompt token's layer-0 entry is ``[kv_a_layernorm(c), rope(k_pe)]`` computed
    directly from the model's weights."""
    llm = _llm(tiny_model_dir("deepseek_v3"), num_kv_blocks=24)
    prompt = random_prompts([11], VOCAB_SIZE, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params)
    runner = llm.engine.runner
    model = runner.model
    layer = model.layers[0]
    attn = layer.self_attn
    assert isinstance(attn, MLAttention)
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    c, k_pe = attn.latent(layer.input_layernorm(model.embed(ids)))
    q_dummy = torch.zeros(len(prompt), 1, attn.rope_dim)
    _, k_rot = attn.rope(positions, q_dummy, k_pe.unsqueeze(1))
    expected = torch.cat([c, k_rot[:, 0]], dim=-1)  # (T, r + rope)
    cached = runner.kv_caches[0][0].reshape(-1, attn.rank + attn.rope_dim)
    written = cached[(cached != 0).any(dim=-1)]
    distance = torch.cdist(expected, written).min(dim=1).values
    assert distance.max() < 1e-5, "a prompt token's latent is not in the cache"


def test_auto_attention_takes_torch_for_a_layout_the_triton_kernels_refuse():
    """On CUDA, ``auto`` picks Triton unless its kernels refuse the model's KV layout
    (DeepSeek's real latent entry, 512 + 64 wide); ``triton`` asked for refuses at load."""
    from warmboot.engine.settings import attention_backend

    cuda = torch.device("cuda")
    wide = lambda: (KVLayout(1, 1, 576), 128)  # noqa: E731
    narrow = lambda: (KVLayout(2, 8, 128), 32)  # noqa: E731
    assert attention_backend("auto", cuda, wide).name == "torch"
    assert attention_backend("auto", cuda, narrow).name == "triton"
    triton = attention_backend("triton", cuda, wide)
    with pytest.raises(ValueError, match="576 wide: use attention_backend='torch'"):
        triton.check_layout(*wide())
