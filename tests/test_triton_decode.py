"""Paged decode attention (Triton, interpreter) against the float64 reference.

Shuffled, non-contiguous block tables with spare blocks holding garbage; outputs poisoned
with NaN. Error bounds: relative <= 2e-3 (fp16, fp32), 1e-2 (bf16); LSE absolute <= 1e-3.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels.decode import paged_decode_attention  # noqa: E402
from warmboot.kernels.reference import paged_decode_ref  # noqa: E402

BOUND = {torch.float16: 2e-3, torch.float32: 2e-3, torch.bfloat16: 1e-2}
LENS = [1, 37, 0, 70]  # length 1, odd, empty, several blocks


def _case(lens, hq, hkv, d, bs, dtype, table_dtype=torch.int32, *params):
    g = torch.Generator().manual_seed(zlib.crc32(repr((lens, hq, hkv, d, bs, params)).encode()))
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
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table.to(table_dtype), torch.tensor(lens, dtype=table_dtype)


def _run(lens, hq, hkv, d=64, bs=16, dtype=torch.float16, window=(-1, -1), softcap=0.0,
         num_splits=2, table_dtype=torch.int32):  # fmt: skip
    q, kc, vc, table, seqlens = _case(lens, hq, hkv, d, bs, dtype, table_dtype, window, softcap)
    out = torch.full_like(q, float("nan"))
    o, lse = paged_decode_attention(
        q, kc, vc, table, seqlens, window_size=window, softcap=softcap,
        num_splits=num_splits, return_lse=True, out=out,
    )  # fmt: skip
    ro, rl = paged_decode_ref(q, kc, vc, table, seqlens, None, window, softcap)
    assert not o.isnan().any()
    err = ((o.double() - ro).norm() / ro.norm()).item()
    assert err <= BOUND[dtype], f"relative error {err:.2e}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    finite = torch.isfinite(rl)
    assert (lse.double() - rl)[finite].abs().max() <= 1e-3
    empty = seqlens == 0
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
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


def test_errors():
    q, kc, vc, table, lens = _case([3], 4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kc[:, :12], vc[:, :12], table, lens)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, kc, vc, table.float(), lens)
