"""Sparse indexed attention (``kernels.sparse_attention``): the selection against a float64
reference of its formula, the tie rule, the indexer keys in the paged cache and the memory
figure, and bad indexer settings refused by name. The families (DeepSeek-V3.2, GLM-5) are
checked against transformers in ``test_families``."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from warmboot import LLM, SamplingParams
from warmboot.architectures import UnsupportedModelError
from warmboot.kernels import sparse_attention
from warmboot.kernels.sparse_attention import select, select_blocks


def _reference(iq, iw, keys, valid, topk):
    """The selection in float64, ties to the earlier position, by a plain loop."""
    b, r = valid.shape[:2]
    out = torch.zeros_like(valid)
    scale = iq.shape[-1] ** -0.5
    for i in range(b):
        for j in range(r):
            s = (iq[i, j].double() @ keys[i].double().T * scale).clamp(min=0)
            score = iw[i, j].double() @ s
            ranked = sorted(
                (p for p in range(valid.shape[2]) if valid[i, j, p]),
                key=lambda p: (-float(score[p]), p),
            )
            out[i, j, ranked[:topk]] = True
    return out


@pytest.mark.parametrize("topk", [1, 5, 40])
def test_selection_matches_float64_reference(topk):
    gen = torch.Generator().manual_seed(3)
    b, r, h, d, length = 3, 4, 16, 12, 23
    iq = torch.randn(b, r, h, d, generator=gen)
    iw = torch.randn(b, r, h, generator=gen)
    keys = torch.randn(b, length, d, generator=gen)
    pos = torch.arange(length - r, length)
    valid = (torch.arange(length)[None, :] <= pos[:, None]).expand(b, r, length).clone()
    valid[1, :, 15:] = False  # NOTE: a shorter sequence in the batch
    got = select(iq, iw, keys, valid, topk)[:, 0]
    assert torch.equal(got, _reference(iq, iw, keys, valid, topk))
    assert (got.sum(-1) == valid.sum(-1).clamp(max=topk)).all()
    assert not (got & ~valid).any()


def test_ties_go_to_the_earlier_position():
    """Scores cut to zero by the ReLU tie; the earliest of them are taken."""
    d, length = 4, 10
    keys = torch.zeros(1, length, d)
    keys[0, [2, 7], 0] = 1.0  # NOTE: the only positive scores; the other 8 are zero
    iq = torch.zeros(1, 1, 1, d)
    iq[..., 0] = 1.0
    iw = torch.ones(1, 1, 1)
    valid = torch.ones(1, 1, length, dtype=torch.bool)
    got = select(iq, iw, keys, valid, topk=5)[:, 0]
    assert got[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 7]
    keys[0, 7, 0] = 2.0  # NOTE: ranked first, then 2, then the zeros in position order
    assert select(iq, iw, keys, valid, topk=3)[0, 0, 0].nonzero().flatten().tolist() == [0, 2, 7]


def _block_reference(iq, keys, valid, topk, block, local):
    """MiniMax-M3's block selection in float64 by plain loops, ties to the earlier block."""
    b, r, g, _ = iq.shape
    length = keys.shape[1]
    out = torch.zeros(b, g, r, length, dtype=torch.bool)
    for i, j, h in itertools.product(range(b), range(r), range(g)):
        past = [p for p in range(length) if valid[i, j, p]]
        score = {}
        for p in past:
            s = float(iq[i, j, h].double() @ keys[i, p].double())
            score[p // block] = max(score.get(p // block, -math.inf), s)
        own = past[-1] // block
        for back in range(local):
            score[max(own - back, 0)] = math.inf
        ranked = sorted(score, key=lambda blk: (-score[blk], blk))[:topk]
        for p in past:
            out[i, h, j, p] = p // block in ranked
    return out


@pytest.mark.parametrize(("topk", "block", "local"), [(1, 4, 1), (3, 4, 1), (2, 3, 2), (9, 5, 0)])
def test_block_selection_matches_float64_reference(topk, block, local):
    gen = torch.Generator().manual_seed(5)
    b, r, g, d, length = 2, 5, 2, 8, 29
    iq = torch.randn(b, r, g, d, generator=gen)
    keys = torch.randn(b, length, d, generator=gen)
    pos = torch.arange(length - r, length)
    valid = (torch.arange(length)[None, :] <= pos[:, None]).expand(b, r, length).clone()
    valid[1, :, 13:] = False
    got = select_blocks(iq, keys, valid, topk, block, local)
    assert torch.equal(got, _block_reference(iq, keys, valid, topk, block, local))


def test_indexer_keys_are_paged_and_counted(tiny_model_dir):
    path = tiny_model_dir("glm_moe_dsa")
    cfg = json.loads((path / "config.json").read_text())
    llm = LLM(str(path), max_model_len=64, block_size=4, num_kv_blocks=16, enforce_eager=True)
    runner = llm.engine.runner
    layout = runner.kv_layout
    assert layout.index_dim == cfg["index_head_dim"]
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    per_layer = (latent + cfg["index_head_dim"]) * 4  # NOTE: float32
    assert runner.kv_bytes_per_token() == cfg["num_hidden_layers"] * per_layer
    pages = runner.kv_caches[0]
    assert len(pages) == 3 and pages[2].shape[-1] == cfg["index_head_dim"]
    assert pages[2].shape[:2] == pages[0].shape[:2]  # NOTE: the KV's blocks, block size
    llm.generate([{"prompt_token_ids": list(range(3, 30))}])
    assert pages[2].abs().sum() > 0  # NOTE: written through the slot mapping
    llm.close()


BAD = [
    ("glm_moe_dsa", dict(index_topk=0), "index_topk"),
    ("glm_moe_dsa", dict(index_n_heads=0), "index_n_heads"),
    ("glm_moe_dsa", dict(index_head_dim=8), "qk_rope_head_dim above index_head_dim"),
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full", "shared"]), "first layer shares"),
    ("glm_moe_dsa", dict(indexer_types=["full", "sparse", "full", "full"]), "indexer_types"),
    ("glm_moe_dsa", dict(layer_types=["indexed_attention", "full_attention"] * 2), "layer_types"),
    ("glm_moe_dsa", dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
    ("minimax_m3", dict(index_n_heads=1), "index_n_heads 1"),
    ("minimax_m3", dict(index_local_blocks=4), "index_local_blocks"),
    ("minimax_m3", dict(index_head_dim=6), "index_head_dim under the rotary dims"),
    ("minimax_m3", dict(index_block_size=0), "index_block_size"),
    ("minimax_m3", dict(layer_types=["minimax_m3_sparse", "sliding_attention"] * 2), "layer_types"),
]


@pytest.mark.parametrize(("kind", "change", "named"), BAD, ids=[f"{k}-{n}" for k, _, n in BAD])
def test_bad_indexer_settings_are_refused(tiny_model_dir, tmp_path, kind, change, named):
    source = tiny_model_dir(kind)
    for f in source.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((source / "config.json").read_text()) | change
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=named):
        LLM(str(tmp_path), max_model_len=64, enforce_eager=True)


def test_a_snapshot_restores_the_same_tokens(tiny_model_dir, tmp_path):
    """bf16: the indexer's head weights stay float32 in memory and in the image; a restored
    engine picks and answers as the one that published."""
    path, store = tiny_model_dir("deepseek_v32"), tmp_path / "store"
    args = dict(max_model_len=96, snapshot_store=str(store), enforce_eager=True, dtype="bfloat16")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold = LLM(str(path), **args)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    weights = [
        m.weights_proj.weight
        for m in cold.engine.runner.model.modules()
        if hasattr(m, "weights_proj")
    ]
    assert weights and all(w.dtype == torch.float32 for w in weights)
    cold.close()
    warm = LLM(str(path), **args)
    assert warm.engine.start_info.path == "restored_image", warm.engine.start_info.reason
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, params)] == expected
    (manifest,) = (store / "manifests").glob("*.json")
    dtypes = {t["name"]: t["dtype"] for t in json.loads(manifest.read_text())["tensors"]}
    assert dtypes["layers.0.self_attn.indexer.weights_proj.weight"] == "float32"
    warm.close()


def test_paged_scores_in_spans_equal_one_pass(monkeypatch):
    """The decode and prefill scores come from the paged keys a span of blocks at a time."""
    gen = torch.Generator().manual_seed(9)
    pages = torch.randn(20, 4, 12, generator=gen)
    table = torch.tensor([[3, 7, 1, 0, 19, 5, 8], [2, 4, 6, 9, 11, 13, 15]])
    iq, iw = torch.randn(2, 3, 5, 12, generator=gen), torch.randn(2, 3, 5, generator=gen)
    whole = sparse_attention.index_scores(iq, iw, pages[table].flatten(1, 2))
    monkeypatch.setattr(sparse_attention, "SCORE_SPAN", 8)  # NOTE: 2 blocks a span: 4 spans
    assert torch.allclose(sparse_attention._paged_scores(iq, iw, pages, table), whole)
