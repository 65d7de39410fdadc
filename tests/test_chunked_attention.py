"""Chunked local attention (``AttentionSpec.chunk``, Llama 4's: a query at ``p`` sees keys
``p - p % chunk`` .. ``p`` only) through the torch backend's every path, against the float64
reference (``kernels.reference``): the native paged decode and extend kernels, the flash
kernel (bfloat16 on AMX), the gathered SDPA paths (native kernels off), and the native
kernels' split contexts. One step mixes decodes and prefills whose positions cross chunk
boundaries inside a prefill chunk and across its cached context; a window too (the later of
the two first keys), sinks and soft-capping. Each case's reference differs from its
chunk-free answer, so the mask is what is checked. The Triton kernels' chunks are in
``test_triton_attention.py`` and ``test_triton_decode.py``, the flash kernel's own in
``test_native_flash_prefill.py``."""

from __future__ import annotations

import pytest
import torch

from warmboot.kernels import native
from warmboot.kernels.backend import AttentionMetadata, PrefillSeq
from warmboot.kernels.reference import varlen_attention_ref
from warmboot.kernels.torch_attention import TorchAttentionBackend

HQ, HKV, D, BS = 6, 2, 64, 4
DECODES = [1, 9, 40, 67]
"""Context lengths of the decode rows (the new token is the last position)."""
PREFILLS = [(30, 30), (67, 16), (25, 3)]
"""(context after the step, new tokens): fresh, over cached context, a short tail."""


def _step(dtype, seed: int):
    """Per sequence its whole K/V (float), the step's q (N, Hq, D), the caches holding every
    position before the step's (the new ones the backend writes), and the metadata."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n, 1) for n in DECODES] + PREFILLS
    blocks = [-(-ctx // BS) for ctx, _ in seqs]
    kc = torch.zeros(sum(blocks) + 1, BS, HKV, D, dtype=dtype)  # NOTE: block 0 unused
    vc = torch.zeros_like(kc)
    full, tables, slots, first = [], [], [], 1
    for (ctx, new), nb in zip(seqs, blocks, strict=True):
        table = torch.arange(first, first + nb).flip(0)  # NOTE: blocks in reverse order
        kv = [torch.randn(ctx, HKV, D, generator=g).to(dtype) for _ in "kv"]
        flat = (table[:, None] * BS + torch.arange(BS)).flatten()[:ctx]
        for cache, t in zip((kc, vc), kv, strict=True):
            cache.view(-1, HKV, D)[flat[: ctx - new]] = t[: ctx - new]
        full.append(kv)
        tables.append(table)
        slots.append(flat[ctx - new :])
        first += nb
    tokens = sum(new for _, new in seqs)
    q = torch.randn(tokens, HQ, D, generator=g).to(dtype)
    k = torch.cat([kv[0][ctx - new :] for kv, (ctx, new) in zip(full, seqs, strict=True)])
    v = torch.cat([kv[1][ctx - new :] for kv, (ctx, new) in zip(full, seqs, strict=True)])
    nd, width = len(DECODES), max(blocks)
    decode_tables = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables[:nd]])
    prefills, start = [], nd
    for (ctx, new), table in zip(PREFILLS, tables[nd:], strict=True):
        prefills.append(PrefillSeq(start, new, ctx, table))
        start += new
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=nd,
        decode_block_tables=decode_tables,
        decode_seq_lens=torch.tensor(DECODES),
        prefills=prefills,
        block_size=BS,
    )
    return full, seqs, q, k, v, kc, vc, meta


def _reference(full, seqs, q, window, softcap, sinks, chunk):
    """float64 rows of the step, each sequence's new tokens the last of its context."""
    cu_q = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor([c for c, _ in seqs]).cumsum(0).tolist()])
    k, v = (torch.cat([kv[i] for kv in full]) for i in (0, 1))
    left = (-1, -1) if window is None else (window - 1, 0)
    out, _ = varlen_attention_ref(
        q, k, v, cu_q, cu_k, 0.125, True, left, softcap or 0.0, sinks, chunk=chunk
    )
    return out


CASES = [(8, None, None, False), (8, 5, None, False), (24, None, 20.0, True), (13, 9, None, True)]
"""(chunk, window, softcap, sinks): chunks shorter than the prefill chunks and longer, a window
that wins at some positions and loses at others."""


@pytest.mark.parametrize("chunk,window,softcap,sinks", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native_kernels", [True, False])
def test_backend_step_with_chunks(chunk, window, softcap, sinks, dtype, native_kernels):
    if native_kernels and native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    full, seqs, q, k, v, kc, vc, meta = _step(dtype, seed=chunk)
    logits = torch.randn(HQ, generator=torch.Generator().manual_seed(1)) if sinks else None
    backend = TorchAttentionBackend(native_kernels=native_kernels)
    out = backend.forward(q, k, v, kc, vc, meta, 0.125, window, softcap, logits, chunk=chunk)
    ref = _reference(full, seqs, q, window, softcap, logits, chunk)
    bound = 1e-5 + 1e-5 * ref.abs()
    if dtype == torch.bfloat16:  # NOTE: SDPA's and the flash kernel's bf16 probabilities
        vmax = max(kv[1].abs().max().double() for kv in full)
        bound = 2**-8 * vmax + 2**-8 * ref.abs()
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and (err <= bound).all(), f"max error {err.max().item():.3g}"
    without = _reference(full, seqs, q, window, softcap, logits, None)
    assert (without - ref).abs().max() > 0.05, "chunks this case can tell from none"


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")
def test_native_split_contexts_with_chunks():
    """Long contexts on two threads: the native kernels split a context between the threads
    (flash-decoding) from the chunk's first position, decode and extend."""
    from warmboot.kernels.native import attention

    g = torch.Generator().manual_seed(7)
    ctx, n, chunk = 1500, 5, 700
    k, v = (torch.randn(ctx, 1, 64, generator=g) for _ in "kv")
    kc, vc = (t.view(-1, 16, 1, 64)[:94] for t in (torch.cat([k, k[:4]]), torch.cat([v, v[:4]])))
    table = torch.arange(94)
    q = torch.randn(n, 4, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ext = attention.paged_extend(q, kc, vc, table, ctx, 0.125, None, None, None, chunk)
        dec = attention.paged_decode(
            q[-1:], kc, vc, table[None], torch.tensor([ctx]), 0.125, None, None, None, chunk
        )
    finally:
        torch.set_num_threads(threads)
    cu = torch.tensor([0, n]), torch.tensor([0, ctx])
    ref, _ = varlen_attention_ref(q, k, v, *cu, 0.125, True, chunk=chunk)
    torch.testing.assert_close(ext.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dec.double(), ref[-1:], atol=1e-5, rtol=1e-5)
    without, _ = varlen_attention_ref(q, k, v, *cu, 0.125, True)
    assert (without - ref).abs().max() > 0.05
