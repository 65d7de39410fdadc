"""Attention sinks (GPT-OSS) in both attention backends against the float64 reference.

One step mixes decode rows and prefill rows over cached context (GQA, shuffled blocks), with
and without a sliding window; sinks include one far above and one far below the scores (the
running max moves to the sink; the sink vanishes). Each check also shows that the same
backend without its sinks misses the reference. The Triton kernels run in the interpreter.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels.backend import AttentionMetadata, PrefillSeq  # noqa: E402
from warmboot.kernels.native import attention as native_attention  # noqa: E402
from warmboot.kernels.reference import paged_decode_ref, varlen_attention_ref  # noqa: E402
from warmboot.kernels.torch_attention import TorchAttentionBackend  # noqa: E402

HQ, HKV, D, BS = 4, 2, 32, 4
DECODES = [1, 9, 70]  # context lengths, the new token included
PREFILLS = [(6, 6), (7, 40), (1, 18)]  # (query_len, context_len): fresh, cached, one token
BOUND = {torch.float32: 2e-3, torch.float16: 2e-3}


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _sinks(g: torch.Generator) -> torch.Tensor:
    sinks = torch.randn(HQ, generator=g) + 1.0
    sinks[1], sinks[2] = 25.0, -30.0  # above every score; negligible
    return sinks


def _step(dtype, seed):
    """(q, k, v, k_cache, v_cache, meta, per-sequence (query rows, full K, full V))."""
    g = _gen(dtype, seed)
    seqs = [(1, n) for n in DECODES] + PREFILLS
    nblk = [-(-ctx // BS) for _, ctx in seqs]
    perm = torch.randperm(sum(nblk) + 2, generator=g)
    shape = (len(perm), BS, HKV, D)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    tables, used, slots, qs, ks, vs, full = [], 0, [], [], [], [], []
    for (n, ctx), nb in zip(seqs, nblk, strict=True):
        table = perm[used : used + nb]
        used += nb
        keys, vals = (torch.randn(ctx, HKV, D, generator=g).to(dtype) for _ in range(2))
        flat = (table[:, None] * BS + torch.arange(BS)).flatten()[:ctx]
        k_cache.view(-1, HKV, D)[flat[: ctx - n]] = keys[: ctx - n]  # the cached context
        v_cache.view(-1, HKV, D)[flat[: ctx - n]] = vals[: ctx - n]
        q = torch.randn(n, HQ, D, generator=g).to(dtype)
        tables.append(table)
        slots.append(flat[ctx - n :])
        qs.append(q), ks.append(keys[ctx - n :]), vs.append(vals[ctx - n :])
        full.append((q, keys, vals))
    nd = len(DECODES)
    width = max(nblk[:nd])
    dec_tables = torch.zeros(nd, width, dtype=torch.int64)
    for i in range(nd):
        dec_tables[i, : nblk[i]] = tables[i]
    prefills, start = [], nd
    for (n, ctx), table in zip(PREFILLS, tables[nd:], strict=True):
        prefills.append(PrefillSeq(start, n, ctx, table.long()))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).long(),
        num_decode_tokens=nd,
        decode_block_tables=dec_tables,
        decode_seq_lens=torch.tensor(DECODES),
        prefills=prefills,
        block_size=BS,
    )
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    return q, k, v, k_cache, v_cache, meta, full


def _reference(full, scale, window, sinks) -> torch.Tensor:
    """float64 (N, Hq, D): each sequence's queries over all its keys, bottom-right causal."""
    left = (-1, -1) if window is None else (window - 1, 0)
    outs = []
    for q, keys, vals in full:
        cu_q = torch.tensor([0, len(q)])
        cu_k = torch.tensor([0, len(keys)])
        o, _ = varlen_attention_ref(q, keys, vals, cu_q, cu_k, scale, True, left, sinks=sinks)
        outs.append(o)
    return torch.cat(outs)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check_backend(backend, dtype, window, seed):
    q, k, v, kc, vc, meta, full = _step(dtype, seed)
    sinks = _sinks(_gen("sinks", seed))
    scale = D**-0.5
    ref = _reference(full, scale, window, sinks)
    out = backend.forward(q, k, v, kc, vc, meta, scale, window, None, sinks)
    assert _err(out, ref) <= BOUND[dtype]
    dropped = backend.forward(q, k, v, kc, vc, meta, scale, window, None, None)
    assert _err(dropped, ref) > 50 * BOUND[dtype]  # the sinks matter to the check


def _backend(native: bool) -> TorchAttentionBackend:
    if native and not native_attention.available():
        pytest.skip("the native kernels are not built here")
    return TorchAttentionBackend(native_kernels=native)


@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_with_sinks(window, native):
    backend = _backend(native)
    _check_backend(backend, torch.float32, window, seed=window)


@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
def test_torch_backend_sinks_with_softcap(native):
    """Soft-cap and sinks together (no family has both today): the explicit path applies
    the cap before the sink joins the softmax."""
    q, k, v, kc, vc, meta, full = _step(torch.float32, "cap")
    sinks = _sinks(_gen("sinks-cap"))
    scale, cap = D**-0.5, 0.7
    outs = []
    for qs, keys, vals in full:
        cu_q, cu_k = torch.tensor([0, len(qs)]), torch.tensor([0, len(keys)])
        o, _ = varlen_attention_ref(
            qs, keys, vals, cu_q, cu_k, scale, True, softcap=cap, sinks=sinks
        )
        outs.append(o)
    backend = _backend(native)
    out = backend.forward(q, k, v, kc, vc, meta, scale, None, cap, sinks)
    assert _err(out, torch.cat(outs)) <= 2e-3


# -- Triton (interpreter) --------------------------------------------------------------------
@pytest.mark.slow  # Triton kernels in the interpreter
@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.float16, 5)])
def test_triton_backend_with_sinks(dtype, window):
    """Decode (two splits: the sink joins in the combine) and prefill over cached context."""
    from warmboot.kernels.triton_backend import TritonAttentionBackend

    _check_backend(TritonAttentionBackend(), dtype, window, seed=("triton", window))


@pytest.mark.slow  # Triton kernels in the interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_sinks_lse(num_splits):
    """The decode kernel's output and LSE (sink included) with the sink added in the kernel
    (one split) and in the combine (three); an empty sequence's LSE is the sink."""
    from warmboot.kernels.decode import paged_decode_attention

    g = _gen("decode", num_splits)
    lens = [0, 1, 37, 70]
    nblk = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(nblk) + 1, generator=g)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(nblk):
        table[b, :nb] = perm[used : used + nb]
        used += nb
    kc, vc = (torch.randn(len(perm), BS, HKV, D, generator=g) for _ in range(2))
    q = torch.randn(len(lens), HQ, D, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    sinks = _sinks(g)
    out, lse = paged_decode_attention(
        q,
        kc,
        vc,
        table,
        seqlens,
        window_size=(20, 0),
        num_splits=num_splits,
        return_lse=True,
        sinks=sinks,
    )
    ref, ref_lse = paged_decode_ref(q, kc, vc, table, seqlens, None, (20, 0), sinks=sinks)
    assert _err(out, ref) <= 2e-3
    assert (lse.double() - ref_lse).abs().max() <= 1e-3
    assert torch.allclose(lse[:, 0], sinks)  # no keys: the sink alone


@pytest.mark.slow  # Triton kernels in the interpreter
def test_triton_varlen_sinks_lse():
    """The prefill kernel (packed K/V, a two-sided window) with sinks: output and LSE."""
    from warmboot.kernels.attention import flash_attn_varlen_func

    g = _gen("varlen")
    lens_q, lens_k = [5, 3, 20], [5, 30, 20]
    q = torch.randn(sum(lens_q), HQ, D, generator=g)
    k, v = (torch.randn(sum(lens_k), HKV, D, generator=g) for _ in range(2))
    cu_q = torch.tensor([0, 5, 8, 28], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 35, 55], dtype=torch.int32)
    sinks = _sinks(g)
    window = (4, -1)  # not causal: rows see keys from pos - 4 on, to the end
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 20, 30, window_size=window, return_lse=True, sinks=sinks
    )
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, window_size=window, sinks=sinks)
    assert _err(out, ref) <= 2e-3
    assert (lse.double() - ref_lse).abs().max() <= 1e-3


# -- the GPT-OSS family on the Triton backend --------------------------------------------------
def _generate(path, backend: str, prompts) -> list:
    from tests.helpers import assert_engine_clean
    from warmboot import LLM, SamplingParams

    llm = LLM(
        str(path),
        max_model_len=96,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        attention_backend=backend,
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_engine_clean(llm)
    return [o.outputs[0] for o in outs]


@pytest.mark.slow  # the engine on Triton kernels in the interpreter
def test_gpt_oss_triton_matches_torch_backend(tiny_model_dir):
    """Sinks through the engine's Triton path (decode, chunked prefill over cached
    context, a prefix hit, sliding and full layers): the torch backend's tokens and logprobs."""
    from tests.helpers import random_prompts
    from tests.tiny_models import VOCAB_SIZE

    path = tiny_model_dir("gpt_oss")
    prompts = random_prompts([30, 3, 17], VOCAB_SIZE, seed=11)
    prompts.append(prompts[0][:16] + [5, 6])
    got, want = _generate(path, "triton", prompts), _generate(path, "torch", prompts)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for lp_g, lp_w, t in zip(g.logprobs, w.logprobs, g.token_ids, strict=True):
            assert abs(lp_g[t].logprob - lp_w[t].logprob) < 1e-4
