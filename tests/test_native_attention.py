"""Native paged attention (``kernels/native/csrc/paged_attention.cpp``) against a float64
reference that gathers each sequence's blocks in Python.

The caches are poisoned: every slot no sequence owns (the unused blocks, block 0 that pads the
block tables, the tail of each sequence's last block) holds NaN, so any read outside a
sequence shows in the output.

Error bounds (inputs of unit scale): float32 1e-5 + 1e-5 * |ref| (worst measured 7e-7
absolute); bfloat16 1e-4 + 2^-8 * |ref| and float16 1e-4 + 2^-10 * |ref|: the one rounding of
the output to its dtype (at most half an ulp, 2^-8 resp. 2^-11 relative) plus the float32
arithmetic (~1e-6). Worst measured: bfloat16 7.7e-3 absolute, 0.95 of its bound (a rounding
just under half an ulp); float16 9e-4, 0.43 of its bound.
"""

from __future__ import annotations

import pytest
import torch

from warmboot.kernels import native
from warmboot.kernels.native import attention

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 2**-8), torch.float16: (1e-4, 2**-10)}


def _paged(lens, hkv, d, bs, dtype, seed, shared=False, spare=3):
    """Caches holding the sequences' blocks in a random order plus spare blocks, the tables
    padded with block 0; every slot no sequence owns is NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = 1 + sum(need) + spare
    k = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v = k if shared else torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    tables = torch.zeros(len(lens), max(need, default=0) + 2, dtype=torch.long)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    owned = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for b, (n, nb) in enumerate(zip(lens, need, strict=True)):
        tables[b, :nb] = torch.tensor(ids[:nb], dtype=torch.long)
        ids = ids[nb:]
        owned[tables[b, :nb]] = True
        if n % bs:
            owned[tables[b, nb - 1], n % bs :] = False
    for cache in {id(k): k, id(v): v}.values():
        cache[~owned] = float("nan")
    return k, v, tables


def _attend(q, k, v, scale, softcap, sinks):
    """float64 attention of q (Hq, D) over k, v (n, Hq, D)."""
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n = s.shape[1]
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None]], dim=1)
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1)[:, :n], v)


def _rows(cache, table, hq):
    """The sequence's positions (ctx, Hq, D) in float64, KV heads repeated per query group."""
    bs, hkv, d = cache.shape[1:]
    return cache[table].reshape(-1, hkv, d).double().repeat_interleave(hq // hkv, dim=1)


def _ref_decode(q, k, v, tables, lens, scale, window=None, softcap=None, sinks=None):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        if n > lo:
            ks, vs = _rows(k, tables[b], q.shape[1]), _rows(v, tables[b], q.shape[1])
            out[b] = _attend(q[b], ks[lo:n], vs[lo:n], scale, softcap, sinks)
    return out


def _ref_extend(q, k, v, table, ctx, scale, window=None, softcap=None, sinks=None):
    out = torch.zeros(q.shape, dtype=torch.float64)
    ks, vs = _rows(k, table, q.shape[1]), _rows(v, table, q.shape[1])
    for i in range(q.shape[0]):
        end = ctx - q.shape[0] + i + 1
        lo = max(0, end - window) if window else 0
        out[i] = _attend(q[i], ks[lo:end], vs[lo:end], scale, softcap, sinks)
    return out


def _check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the output: a poisoned slot was read"
    atol, rtol = TOL[dtype]
    err = (out.double() - ref).abs()
    assert (err <= atol + rtol * ref.abs()).all(), f"max error {err.max().item():.3g}"


def _decode_case(
    lens, hq, hkv, d, bs, dtype, window=None, softcap=None, sinks=False, shared=False, seed=0
):
    k, v, tables = _paged(lens, hkv, d, bs, dtype, seed, shared)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    sink = torch.randn(hq, generator=g) if sinks else None
    scale = d**-0.5
    out = attention.paged_decode(q, k, v, tables, torch.tensor(lens), scale, window, softcap, sink)
    ref = _ref_decode(q, k, v, tables, lens, scale, window, softcap, sink)
    _check(out, ref, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,bs",
    [(4, 4, 64, 16), (9, 3, 80, 32), (16, 2, 128, 16), (6, 2, 72, 5), (3, 1, 64, 1)],
)
def test_decode(hq, hkv, d, bs, dtype):
    """GQA groups 1/3/8, odd head dims, block sizes 16/32/5/1, ragged lengths: one token,
    a block boundary either side, a long context."""
    _decode_case([1, bs, bs + 1, 700, 37], hq, hkv, d, bs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "window,softcap,sinks",
    [
        (50, None, False),
        (1, None, False),
        (None, 30.0, False),
        (None, None, True),
        (64, 20.0, True),
    ],
)
def test_decode_window_softcap_sinks(window, softcap, sinks, dtype):
    _decode_case([1, 16, 49, 50, 51, 300], 9, 3, 64, 16, dtype, window, softcap, sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_one_cache_as_k_and_v(dtype):
    """MLA's latent cache: v_cache is k_cache (576 = 512 + 64 dims, one KV head)."""
    _decode_case([5, 100, 33], 8, 1, 576, 16, dtype, shared=True)


@pytest.mark.parametrize("batch", [1, 32])
def test_decode_batch(batch):
    lens = torch.randint(1, 300, (batch,), generator=torch.Generator().manual_seed(batch))
    _decode_case(lens.tolist(), 9, 3, 64, 16, torch.bfloat16, window=200, sinks=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"window": 40, "softcap": 25.0, "sinks": True}])
def test_every_instruction_set(isa, dtype, options):
    _decode_case([1, 17, 130], 9, 3, 72, 16, dtype, **options)


@pytest.mark.parametrize("options", [{}, {"window": 1100, "sinks": True}])
def test_decode_splits_long_context(options):
    """Fewer (sequence, KV head) pairs than threads: the context is split and the partial
    softmaxes merged; the same numbers as one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out2 = _decode_case([1500], 4, 1, 64, 16, torch.float32, **options)
        torch.set_num_threads(1)
        out1 = _decode_case([1500], 4, 1, 64, 16, torch.float32, **options)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out1, out2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("lens", [[1500], [3, 700, 40, 1, 260, 90, 17, 300, 5]])
def test_a_helper_thread_takes_attention_work(lens):
    """``csrc/pool.cpp``: one torch thread and a helper split the items (and a lone long
    sequence's context) as two torch threads do; same numbers as one thread alone."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _decode_case(lens, 8, 2, 64, 16, torch.float32, window=1200, sinks=True)
        assert native.use_helpers(1, []) == 1
        for _ in range(20):  # NOTE: races show up as wrong numbers in some rounds
            lent = _decode_case(lens, 8, 2, 64, 16, torch.float32, window=1200, sinks=True)
            torch.testing.assert_close(lent, alone, atol=1e-6, rtol=1e-6)
    finally:
        native.use_helpers(0, [])
        torch.set_num_threads(threads)


@pytest.mark.parametrize("sinks", [False, True])
def test_decode_empty_sequence_gives_zeros(sinks):
    out = _decode_case([0, 5], 4, 2, 64, 16, torch.float32, sinks=sinks)
    assert (out[0] == 0).all()


@pytest.mark.parametrize(
    "n,ctx,bs,d,window,softcap,sinks",
    [
        (1, 1, 16, 64, None, None, False),
        (5, 5, 16, 64, None, None, False),  # no cached context
        (37, 100, 16, 64, None, None, False),  # more tokens than one work item's 16
        (16, 300, 5, 80, 64, None, False),
        (20, 70, 16, 64, 30, 25.0, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend(n, ctx, bs, d, window, softcap, sinks, dtype):
    hq, hkv = 9, 3
    k, v, tables = _paged([ctx], hkv, d, bs, dtype, seed=n)
    table = tables[0, : -(-ctx // bs)]
    g = torch.Generator().manual_seed(ctx)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    sink = torch.randn(hq, generator=g) if sinks else None
    out = attention.paged_extend(q, k, v, table, ctx, d**-0.5, window, softcap, sink)
    _check(out, _ref_extend(q, k, v, table, ctx, d**-0.5, window, softcap, sink), dtype)


def test_extend_splits_long_context():
    """A chunk of one sequence with one KV head on two threads: the context is split too."""
    k, v, tables = _paged([1500], 1, 64, 16, torch.float32, seed=7)
    table = tables[0, :94]
    q = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = attention.paged_extend(q, k, v, table, 1500, 0.125, 1200, None, torch.ones(4))
    finally:
        torch.set_num_threads(threads)
    ref = _ref_extend(q, k, v, table, 1500, 0.125, 1200, None, torch.ones(4))
    _check(out, ref, torch.float32)


@pytest.mark.skipif(not native.amx(), reason="no AMX tiles here (CPU flags or the OS's permission)")
@pytest.mark.parametrize(
    "n,ctx,window", [(64, 64, None), (80, 200, None), (70, 70, 33), (96, 130, 50)]
)
def test_tiled_prefill(n, ctx, window, monkeypatch):
    """bfloat16 chunks of ``TILED_PREFILL_ROWS`` rows or more on AMX: the backend runs SDPA
    (not the native op), fresh and over cached context, against the float64 reference. Bound:
    SDPA's flash kernel rounds the probabilities to bfloat16 before multiplying V (2^-9 of
    each), so 2^-8 * max|v| + 2^-8 * |ref| (worst measured: 0.35 of it)."""
    from warmboot.kernels.backend import PrefillSeq
    from warmboot.kernels.torch_attention import TILED_PREFILL_ROWS, TorchAttentionBackend

    assert n >= TILED_PREFILL_ROWS
    k, v, tables = _paged([ctx], 3, 64, 16, torch.bfloat16, seed=n)
    table = tables[0, : -(-ctx // 16)]
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(ctx)).to(torch.bfloat16)
    seen_k, seen_v = (c[table].reshape(-1, 3, 64)[:ctx] for c in (k, v))

    def refuse(*args):
        raise AssertionError("the native op ran a tiled prefill")

    monkeypatch.setattr(attention, "paged_extend", refuse)
    seq = PrefillSeq(query_start=0, query_len=n, context_len=ctx, block_table=table)
    backend = TorchAttentionBackend(native_kernels=True)
    out = backend._prefill(
        q, seen_k[ctx - n :], seen_v[ctx - n :], k, v, seq, 0.125, window, None, None
    )
    ref = _ref_extend(q, k, v, table, ctx, 0.125, window)
    err = (out.double() - ref).abs()
    bound = 2**-8 * seen_v.abs().max().double() + 2**-8 * ref.abs()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


def test_matches_torch_backend_decode():
    """The backend's own decode path (gather + SDPA) and the native op agree."""
    from warmboot.kernels.backend import AttentionMetadata
    from warmboot.kernels.torch_attention import TorchAttentionBackend

    lens = [3, 16, 90]
    k, v, tables = _paged(lens, 2, 64, 16, torch.float32, seed=3)
    k, v = k.nan_to_num(), v.nan_to_num()  # NOTE: SDPA multiplies masked slots by 0
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(4))
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(5))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.long),
        num_decode_tokens=3,
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(lens),
        prefills=[],
        block_size=16,
    )
    for window, softcap, s in [(None, None, None), (20, 30.0, sinks)]:
        grouped = None if s is None else s.view(2, -1, 1)
        ref = TorchAttentionBackend(native_kernels=False)._decode(
            q, k, v, meta, 0.125, window, softcap, grouped
        )
        out = attention.paged_decode(
            q, k, v, tables, meta.decode_seq_lens, 0.125, window, softcap, s
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rejects_bad_inputs():
    k, v, tables = _paged([20], 2, 64, 16, torch.float32, seed=0)
    q, lens = torch.randn(1, 4, 64), torch.tensor([20])
    bad = [
        ((q.bfloat16(), k, v, tables, lens), "q is"),
        ((q, k, v.double(), tables, lens), "q is"),
        ((torch.randn(1, 3, 64), k, v, tables, lens), "not a multiple"),
        ((torch.randn(1, 4, 32), k, v, tables, lens), "head_dim"),
        ((q, k, v, tables.int(), lens), "block_tables"),
        ((q, k, v, tables, torch.tensor([10**4])), "seq_lens"),
        ((q, k, v, torch.full_like(tables, 10**6), lens), "out of range"),
        ((q, k.transpose(2, 3).contiguous().transpose(2, 3), v, tables, lens), "contiguous"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            attention.paged_decode(*args, scale=0.125)
    with pytest.raises(RuntimeError, match="context_len"):
        attention.paged_extend(q, k, v, tables[0], 10**4, 0.125)


def test_fake_tensors_have_the_output_shape():
    """Meta kernels: torch.compile traces the ops without running them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(3, 8, 64, dtype=torch.bfloat16), torch.empty(9, 16, 2, 64).bfloat16()
        out = attention.paged_decode(
            q, k, k, torch.zeros(3, 4, dtype=torch.long), torch.ones(3, dtype=torch.long), 0.1
        )
        ext = attention.paged_extend(q, k, k, torch.zeros(4, dtype=torch.long), 10, 0.1)
    assert out.shape == ext.shape == (3, 8, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_what_index_copy_writes(dtype):
    """``csrc/write_kv.cpp``: rows viewed out of a fused QKV projection (tokens 960 apart)
    land where ``index_copy_`` puts them, nothing else changes; a slot outside the cache is
    refused; what the op does not take (one cache for both, another dtype) is left to torch."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 960, generator=g).to(dtype)
    k, v = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)
    caches = [torch.randn(4, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    slots = torch.tensor([17, 0, 63, 5, 40])
    want = [c.clone() for c in caches]
    for c, x in zip(want, (k, v), strict=True):
        c.view(-1, 3, 64).index_copy_(0, slots, x)
    assert attention.write_kv(k, v, *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache"):
        attention.write_kv(k, v, *caches, torch.tensor([1, 2, 3, 4, 64]))
    assert not attention.write_kv(k, k, caches[0], caches[0], slots)
    assert not attention.write_kv(k.half(), v.half(), *caches, slots)


def _fresh_batch(lens: list[int], dtype, seed: int):
    """A step's q (N, 9, 64), k and v (N, 3, 64) for fresh prefills of ``lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


def _sdpa_rows(q, k, v, start: int, n: int) -> torch.Tensor:
    rows = slice(start, start + n)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t[rows].transpose(0, 1)[None] for t in (q, k, v)),
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.fixture
def no_tiles():
    """AMX off for the native ops (``use_amx``): ``causal_prefill`` runs its SDPA calls."""
    allowed = native.amx()  # NOTE: read now; a test may patch ``native.amx`` before teardown
    torch.ops.warmboot_cpu.use_amx(False)
    yield
    torch.ops.warmboot_cpu.use_amx(allowed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_prefill_gives_sdpa_bits_lent_a_helper_or_not(dtype, no_tiles):
    """``csrc/causal_prefill.cpp`` without its flash kernel (no AMX tiles): a call per
    sequence and KV head gives the bits of one SDPA call per sequence over all heads,
    whichever thread runs it; rows of sequences not named (here the last) are left as they
    were. (The flash kernel: ``test_native_flash_prefill.py``.)"""
    from tests.helpers import lent_a_helper

    lens = [70, 5, 130, 9]
    q, k, v, starts = _fresh_batch(lens, dtype, seed=len(lens))
    refs = [_sdpa_rows(q, k, v, s, n) for s, n in zip(starts, lens, strict=True)]

    def run() -> torch.Tensor:
        out = torch.full_like(q, 7.0)
        attention.causal_prefill(q, k, v, out, starts[:3], lens[:3], 0.125)
        return out

    def check(out: torch.Tensor) -> None:
        for s, n, ref in zip(starts[:3], lens[:3], refs, strict=False):
            assert torch.equal(out[s : s + n], ref)
        assert (out[starts[3] :] == 7.0).all()

    check(run())
    lent_a_helper(lambda: check(run()))


def test_causal_prefill_refuses_rows_outside_the_step():
    q, k, v, _ = _fresh_batch([10], torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="outside the 10 tokens"):
        attention.causal_prefill(q, k, v, torch.empty_like(q), [4], [7], 0.125)
    with pytest.raises(RuntimeError, match="query heads over"):
        attention.causal_prefill(q[:, :8], k, v, torch.empty_like(q[:, :8]), [0], [10], 0.125)


def test_backend_runs_fresh_tiled_prefills_in_one_call(monkeypatch, no_tiles):
    """On AMX (faked here: the op runs on any CPU) where the flash kernel does not run, the
    step's fresh bfloat16 prefills of ``TILED_PREFILL_ROWS`` rows or more go through one
    ``causal_prefill`` call; a shorter one and one over cached context take the per-sequence
    path; every row as that path gives."""
    from tests.helpers import prefill_meta
    from warmboot.kernels.backend import PrefillSeq
    from warmboot.kernels.torch_attention import TILED_PREFILL_ROWS, TorchAttentionBackend

    monkeypatch.setattr(native, "amx", lambda: True)
    monkeypatch.setattr(attention, "flash_prefill", lambda *tensors: False)
    lens, ctx = [TILED_PREFILL_ROWS, 20, 100, 70], [TILED_PREFILL_ROWS, 20, 100, 90]
    q, k, v, starts = _fresh_batch(lens, torch.bfloat16, seed=2)
    kc, vc, tables = _paged(ctx, 3, 64, 16, torch.bfloat16, seed=3)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    seqs = [
        PrefillSeq(s, n, c, tables[i, : -(-c // 16)])
        for i, (s, n, c) in enumerate(zip(starts, lens, ctx, strict=True))
    ]
    calls = []
    real = attention.causal_prefill
    monkeypatch.setattr(attention, "causal_prefill", lambda *a: calls.append(a[4:6]) or real(*a))
    meta = prefill_meta(seqs, sum(lens))
    backend = TorchAttentionBackend(native_kernels=True)
    monkeypatch.setattr(attention, "write_kv", lambda *a: True)  # NOTE: the caches as built
    out = backend.forward(q, k, v, kc, vc, meta, 0.125, None)
    assert calls == [([starts[0], starts[2]], [lens[0], lens[2]])]
    for seq in seqs:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        one = backend._prefill(q[rows], k[rows], v[rows], kc, vc, seq, 0.125, None, None, None)
        assert torch.equal(out[rows], one)
