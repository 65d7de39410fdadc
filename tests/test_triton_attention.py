"""Varlen flash-attention (Triton, interpreter) against the float64 reference.

Fresh random inputs per case (seeded from the case parameters), outputs poisoned with NaN.
Error bounds: relative ||out - ref|| / ||ref|| <= 2e-3 (fp16, fp32), 1e-2 (bf16); LSE
absolute <= 1e-3 where finite, and -inf exactly where the reference row is fully masked.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels.attention import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from warmboot.kernels.reference import varlen_attention_ref  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter
BOUND = {torch.float16: 2e-3, torch.float32: 2e-3, torch.bfloat16: 1e-2}
LENS = ([5, 0, 1, 37, 20], [5, 0, 3, 37, 50])  # empty, length 1, cached context, odd sizes


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lens_q, lens_k, hq, hkv, d, dtype, *params):
    g = _gen(lens_q, lens_k, hq, hkv, d, dtype, *params)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype)
    return q, k, v


def _check(out, lse, ref_out, ref_lse, dtype) -> float:
    assert not out.isnan().any(), "NaN left in the output"
    err = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    assert err <= BOUND[dtype], f"relative error {err:.2e}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "masked rows' LSE"
    finite = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max() <= 1e-3
    return err


def _run(
    lens_q,
    lens_k,
    hq,
    hkv,
    d,
    dtype=torch.float16,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    **kw,
):
    q, k, v = _inputs(lens_q, lens_k, hq, hkv, d, dtype, causal, window, softcap)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = torch.full_like(q, float("nan"))
    o, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        causal=causal,
        window_size=window,
        softcap=softcap,
        return_lse=True,
        out=out,
        **kw,
    )
    assert o is out
    chunk = kw.get("chunk")
    ref = varlen_attention_ref(q, k, v, cu_q, cu_k, None, causal, window, softcap, chunk=chunk)
    return _check(o, lse, *ref, dtype), o


# (mask name, Hq, Hkv, causal, window, softcap): every mask, GQA ratios 1/2/4/8
MASKS = [
    ("none", 4, 4, False, (-1, -1), 0.0),
    ("causal", 4, 2, True, (-1, -1), 0.0),
    ("window", 8, 2, False, (5, 3), 0.0),
    ("left_window", 2, 1, False, (9, -1), 0.0),
    ("causal_window", 8, 1, True, (7, -1), 0.0),
    ("softcap", 4, 1, False, (-1, -1), 3.0),
    ("causal_softcap", 2, 2, True, (-1, -1), 3.0),
]


@pytest.mark.parametrize("case", MASKS, ids=[m[0] for m in MASKS])
def test_masks_and_gqa(case):
    _, hq, hkv, causal, window, cap = case
    _run(*LENS, hq, hkv, 64, causal=causal, window=window, softcap=cap)


@pytest.mark.parametrize(
    "chunk,window,paged", [(8, (-1, -1), False), (24, (-1, -1), True), (8, (5, -1), True)]
)
def test_chunks(chunk, window, paged):
    """Chunked local attention (Llama 4's): each query sees its chunk's keys only, chunks
    shorter and longer than a key block, boundaries inside the queries and across cached
    context (37 queries over 50 keys), with a window too; packed and through a block table.
    The reference without the chunk differs, so the mask is what is checked."""
    lens_q, lens_k = [5, 1, 37, 20], [5, 9, 50, 20]
    if not paged:
        _run(lens_q, lens_k, 4, 2, 64, causal=True, window=window, chunk=chunk)
        return
    q, k, v = _inputs(lens_q, lens_k, 4, 2, 64, torch.float16, "chunk", chunk)
    bs, cu_q, cu_k = 4, _cu(lens_q), _cu(lens_k)
    blocks = [-(-n // bs) for n in lens_k]
    table = torch.zeros(len(lens_k), max(blocks), dtype=torch.int32)
    k_cache = torch.zeros(sum(blocks) + 1, bs, 2, 64, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    first = 1  # NOTE: block 0 unused
    for b, n in enumerate(lens_k):
        table[b, : blocks[b]] = torch.arange(first, first + blocks[b]).flip(0)  # reversed
        rows = slice(cu_k[b], cu_k[b] + n)
        for i in range(blocks[b]):
            part = slice(i * bs, min(n, (i + 1) * bs))
            k_cache[table[b, i], : part.stop - part.start] = k[rows][part]
            v_cache[table[b, i], : part.stop - part.start] = v[rows][part]
        first += blocks[b]
    lens = torch.tensor(lens_k, dtype=torch.int32)
    opts = dict(causal=True, window_size=window, block_table=table, seqused_k=lens)
    o, lse = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, None, 37, 50, return_lse=True, chunk=chunk, **opts
    )
    ref = varlen_attention_ref(q, k, v, cu_q, cu_k, None, True, window, chunk=chunk)
    _check(o, lse, *ref, torch.float16)
    without = varlen_attention_ref(q, k, v, cu_q, cu_k, None, True, window)[0]
    assert (ref[0] - without).abs().max() > 0.1


@pytest.mark.parametrize("d", [16, 96, 128, 256])
def test_head_dims(d):
    _run([7, 19], [30, 19], 2, 1, d, causal=True)


def test_more_queries_than_keys_rows_fully_masked():
    """Bottom-right causal with q_len > k_len: the first rows see no key (out 0, LSE -inf)."""
    _, o = _run([9, 3], [4, 3], 2, 1, 64, causal=True)
    assert torch.equal(o[:5], torch.zeros_like(o[:5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes(dtype):
    _run([13, 30], [13, 41], 4, 2, 64, dtype=dtype, causal=True)


def test_tau_zero_and_eight_agree_on_growing_scores():
    """Keys whose scores grow along the sequence: tau=8 skips rescales, tau=0 does all."""
    lens = [40, 64]
    q, k, v = _inputs(lens, lens, 2, 1, 64, torch.float16, "tau")
    ramp = torch.linspace(0, 3, 64).repeat(2)[: sum(lens)][:, None, None]
    k = (k.float() * 0.3 + ramp * q[:, :1].float().sign()).half()
    q = (q.float().sign() * 1.5).half()
    cu = _cu(lens)
    outs = []
    for tau in (0.0, 8.0):
        out = torch.full_like(q, float("nan"))
        o, lse = flash_attn_varlen_func(
            q, k, v, cu, cu, 64, 64, causal=True, return_lse=True, tau=tau, out=out
        )
        _check(o, lse, *varlen_attention_ref(q, k, v, cu, cu, None, True), torch.float16)
        outs.append(o.float())
    assert (outs[0] - outs[1]).abs().max() < 2e-3


@pytest.mark.parametrize("fraction", [0.125, 0.5, 1.0])
def test_exp2_emulation_fraction(fraction):
    err, _ = _run(*LENS, 4, 2, 64, causal=True, emulate_fraction=fraction)
    assert err < 1e-3


def test_plain_order_matches_lpt_bitwise():
    q, k, v = _inputs(*LENS, 4, 2, 64, torch.float16, "lpt")
    cu_q, cu_k = _cu(LENS[0]), _cu(LENS[1])
    a = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 50, causal=True, lpt=True)
    b = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 50, causal=True, lpt=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_kv_matches_reference(block_size):
    """K/V read through a shuffled block table (the engine's prefill over cached context)."""
    lens_q, lens_k = [6, 1, 17], [21, 9, 17]
    q, k, v = _inputs(lens_q, lens_k, 4, 2, 64, torch.float16, "paged", block_size)
    g = _gen("table", block_size)
    nblk = [-(-n // block_size) for n in lens_k]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, block_size, 2, 64, generator=g).half()
    v_cache = torch.randn(num_blocks, block_size, 2, 64, generator=g).half()
    table = torch.zeros(3, max(nblk), dtype=torch.int32)
    used, start = 0, 0
    for b, n in enumerate(lens_k):
        blocks = perm[used : used + nblk[b]]
        table[b, : nblk[b]] = blocks
        flat_k, flat_v = k[start : start + n], v[start : start + n]
        for i in range(nblk[b]):
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            k_cache[blocks[i], : rows.stop - rows.start] = flat_k[rows]
            v_cache[blocks[i], : rows.stop - rows.start] = flat_v[rows]
        used, start = used + nblk[b], start + n
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = torch.full_like(q, float("nan"))
    o, lse = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_q,
        None,
        17,
        21,
        causal=True,
        return_lse=True,
        out=out,
        block_table=table,
        seqused_k=torch.tensor(lens_k, dtype=torch.int32),
    )
    ref = varlen_attention_ref(q, k, v, cu_q, cu_k, None, True)
    _check(o, lse, *ref, torch.float16)


def test_batched_api_matches_varlen():
    g = _gen("batched")
    q = torch.randn(2, 19, 4, 64, generator=g).half()
    k = torch.randn(2, 23, 2, 64, generator=g).half()
    v = torch.randn(2, 23, 2, 64, generator=g).half()
    o, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    cu_q, cu_k = _cu([19, 19]), _cu([23, 23])
    ro, rl = varlen_attention_ref(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, None, True
    )
    assert o.shape == q.shape and lse.shape == (2, 4, 19)
    _check(o.flatten(0, 1), lse.transpose(0, 1).flatten(1), ro, rl, torch.float16)


def test_input_errors():
    q = torch.zeros(4, 3, 64, dtype=torch.float16)
    k = torch.zeros(4, 2, 64, dtype=torch.float16)
    cu = _cu([4])
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_varlen_func(q, k, k, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_varlen_func(q.int(), k, k, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_varlen_func(q, k[..., :32], k[..., :32], cu, cu, 4, 4)


@pytest.mark.parametrize("window,chunk", [(None, None), (5, None), (None, 4)])
def test_pretune_probe_is_the_engines_prefill(window, chunk):
    """The start-up tuning's synthetic prefill (zero queries over the cache's first blocks)
    is a well-formed engine prefill: each row averages V over exactly its visible keys (a
    chunked layer's too)."""
    from warmboot.kernels.triton_backend import prefill_probe

    g = _gen("probe", window or 0)
    k_cache = torch.randn(7, 4, 2, 16, generator=g).half()
    v_cache = torch.randn(7, 4, 2, 16, generator=g).half()
    q_len, k_len = 6, 19
    out = prefill_probe(k_cache, v_cache, 4, 0.25, window, q_len, k_len, chunk)
    k, v = k_cache.flatten(0, 1)[:k_len], v_cache.flatten(0, 1)[:k_len]
    left = -1 if window is None else window - 1
    ref, _ = varlen_attention_ref(
        torch.zeros(q_len, 4, 16, dtype=torch.float16),
        k,
        v,
        _cu([q_len]),
        _cu([k_len]),
        0.25,
        True,
        (left, 0),
        chunk=chunk,
    )
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= BOUND[torch.float16], err
