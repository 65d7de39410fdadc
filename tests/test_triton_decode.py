"""Paged decode attention (Triton, interpreter) against the float64 reference.

Shuffled, non-contiguous block tables with spare blocks holding garbage; outputs poisoned
with NaN. Error bounds: relative <= 2e-3 (fp16, fp32), 1e-2 (bf16); LSE absolute <= 1e-3.
Several query tokens per sequence (``query_len``) are checked against the varlen reference
over each sequence's gathered keys, sequences shorter than ``query_len`` included.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels.decode import paged_decode_attention  # noqa: E402
from warmboot.kernels.reference import paged_decode_ref, varlen_attention_ref  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter
BOUND = {torch.float16: 2e-3, torch.float32: 2e-3, torch.bfloat16: 1e-2}
LENS = [1, 37, 0, 70]  # length 1, odd, empty, several blocks
LENS_MULTI = [3, 34, 0, 70, 1, 5]  # shorter than query_len 4, a split inside the last 3, empty


def _case(lens, hq, hkv, d, bs, dtype, table_dtype=torch.int32, *params, query_len=1):
    key = repr((lens, hq, hkv, d, bs, query_len, params))
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    nblk = [-(-n // bs) for n in lens]
    num_blocks = sum(nblk) + 5
    perm = torch.randperm(num_blocks, generator=g)
    width = max(nblk) + 1
    table = torch.randint(0, num_blocks, (len(lens), width), generator=g)  # padding: junk ids
    used = 0
    for b, n in enumerate(nblk):
        table[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens) * query_len, hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table.to(table_dtype), torch.tensor(lens, dtype=table_dtype)


def _multi_ref(q, kc, vc, table, seqlens, query_len, window, softcap, chunk=None):
    """float64 (out, lse) of query_len causal tokens per sequence: the varlen reference over
    each sequence's keys gathered from its blocks."""
    lens = seqlens.tolist()
    bs = kc.shape[1]

    def gather(cache):
        return torch.cat(
            [cache[table[b, : -(-n // bs)].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)]
        )

    cu_q = torch.arange(0, (len(lens) + 1) * query_len, query_len)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return varlen_attention_ref(
        q, gather(kc), gather(vc), cu_q, cu_k, None, True, window, softcap, chunk=chunk
    )


def _run(
    lens,
    hq,
    hkv,
    d=64,
    bs=16,
    dtype=torch.float16,
    window=(-1, -1),
    softcap=0.0,
    num_splits=2,
    table_dtype=torch.int32,
    query_len=1,
    strided=False,
    chunk=None,
):
    q, kc, vc, table, seqlens = _case(
        lens, hq, hkv, d, bs, dtype, table_dtype, window, softcap, strided, query_len=query_len
    )
    out = torch.full_like(q, float("nan"))
    if strided:  # rows and heads further apart than D, NaN between them
        q = torch.cat([q, torch.full_like(q, float("nan"))], -1)[..., :d]
        out = torch.cat([out, out], -1)[..., :d]
    o, lse = paged_decode_attention(
        q,
        kc,
        vc,
        table,
        seqlens,
        window_size=window,
        softcap=softcap,
        num_splits=num_splits,
        return_lse=True,
        query_len=query_len,
        out=out,
        chunk=chunk,
    )
    if query_len == 1:
        ro, rl = paged_decode_ref(q, kc, vc, table, seqlens, None, window, softcap, chunk=chunk)
    else:
        ro, rl = _multi_ref(q, kc, vc, table, seqlens, query_len, window, softcap, chunk)
    assert o.data_ptr() == out.data_ptr() and not o.isnan().any()
    err = ((o.double() - ro).norm() / ro.norm()).item()
    assert err <= BOUND[dtype], f"relative error {err:.2e}"
    assert lse.shape == (hq, len(lens) * query_len)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    finite = torch.isfinite(rl)
    assert (lse.double() - rl)[finite].abs().max() <= 1e-3
    dead = torch.isneginf(rl).T  # (token, head) without a visible key: exactly 0
    assert torch.equal(o[dead], torch.zeros_like(o[dead]))
    return err


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_gqa_ratios(hq, hkv):
    _run(LENS, hq, hkv)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_splits(num_splits):
    _run(LENS, 4, 2, num_splits=num_splits)


@pytest.mark.parametrize("bs", [16, 64])
def test_block_sizes(bs):
    _run(LENS, 4, 2, bs=bs)


def test_sliding_window():
    _run(LENS, 4, 2, window=(9, 0), num_splits=3)


def test_softcap():
    _run(LENS, 4, 1, softcap=2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_and_int64_tables(dtype):
    _run(LENS, 4, 2, d=16, dtype=dtype, table_dtype=torch.int64)


def test_head_dim_96():
    _run([5, 30], 2, 1, d=96)


@pytest.mark.parametrize("query_len", [2, 4])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
def test_multi_token_gqa_ratios(hq, hkv, query_len):
    _run(LENS_MULTI, hq, hkv, query_len=query_len)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_multi_token_splits(num_splits):
    _run(LENS_MULTI, 4, 2, query_len=4, num_splits=num_splits)


@pytest.mark.parametrize(
    "window,num_splits",
    [((9, 0), 3), ((2, 0), 2), ((0, -1), 1)],  # wider than query_len, narrower, own key only
)
def test_multi_token_sliding_window(window, num_splits):
    _run(LENS_MULTI, 4, 2, query_len=4, window=window, num_splits=num_splits)


@pytest.mark.parametrize(
    "query_len,chunk,window,num_splits",
    [(1, 8, (-1, -1), 3), (1, 24, (15, 0), 2), (4, 8, (-1, -1), 2), (4, 24, (10, 0), 3)],
)
def test_chunks(query_len, chunk, window, num_splits):
    """Chunked local attention (Llama 4's): each token sees its chunk's keys only, chunks
    shorter and longer than a key block, the new tokens of one sequence across a boundary
    (30 .. 33 cross 32 with chunks of 8), with a window too (the later first key: the window's
    at 69, the chunk's at 33). The reference without the chunk differs, so the mask is what
    is checked."""
    _run(LENS_MULTI, 4, 2, query_len=query_len, chunk=chunk, window=window, num_splits=num_splits)
    q, kc, vc, table, lens = _case(LENS_MULTI, 4, 2, 16, 16, torch.float32, query_len=query_len)
    with_chunk = _multi_ref(q, kc, vc, table, lens, query_len, window, 0.0, chunk)[0]
    without = _multi_ref(q, kc, vc, table, lens, query_len, window, 0.0)[0]
    assert (with_chunk - without).abs().max() > 0.1


def test_multi_token_softcap():
    _run(LENS_MULTI, 4, 1, query_len=2, softcap=2.5)


def test_multi_token_odd_group_strided_block_64():
    _run(LENS_MULTI, 6, 2, bs=64, query_len=3, strided=True)  # 9 rows: group 3 x 3 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_dtypes(dtype):
    _run(LENS_MULTI, 4, 2, d=16, dtype=dtype, table_dtype=torch.int64, query_len=2)


def test_multi_token_reference_agrees_at_query_len_1():
    q, kc, vc, table, lens = _case(LENS, 4, 2, 16, 16, torch.float32)
    ro, rl = paged_decode_ref(q, kc, vc, table, lens, None, (5, 0), 0.0)
    mo, ml = _multi_ref(q, kc, vc, table, lens, 1, (5, 0), 0.0)
    torch.testing.assert_close(mo, ro)
    torch.testing.assert_close(ml, rl)


def test_errors():
    q, kc, vc, table, lens = _case([3], 4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kc[:, :12], vc[:, :12], table, lens)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, kc, vc, table.float(), lens)
    with pytest.raises(ValueError, match="batch \\* query_len = 1 \\* 2"):
        paged_decode_attention(q, kc, vc, table, lens, query_len=2)
    with pytest.raises(ValueError, match="query_len must be an int >= 1"):
        paged_decode_attention(q[:0], kc, vc, table, lens, query_len=0)
    with pytest.raises(ValueError, match="seqused_k"):
        paged_decode_attention(q, kc, vc, table, lens[:0])
    with pytest.raises(ValueError, match="causal"):
        paged_decode_attention(q, kc, vc, table, lens, window_size=(4, 2))
    with pytest.raises(ValueError, match="out must match"):
        paged_decode_attention(q, kc, vc, table, lens, out=q[:, :2])
