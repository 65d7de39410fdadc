"""The flash kernel for bfloat16 prefills on AMX tiles (``csrc/flash_prefill.cpp``, behind
``causal_prefill`` for fresh prefills and ``paged_prefill`` over cached context): each row
against a float64 reference, every head size and GQA group it takes, odd lengths, a running
max that moves (the lazy rescale), windows, chunks and sinks, the same bits lent a helper or
not, soft-capped scores, bad input refused, and the backend's routing. Skipped where the tiles
are not usable (an AMD EPYC, gVisor)."""

from __future__ import annotations

import pytest
import torch

from warmboot.kernels import native
from warmboot.kernels.native import attention

pytestmark = pytest.mark.skipif(
    native.library() is None or not native.amx(),
    reason="the flash kernel needs the native library and AMX tiles (CPU flags, OS permission)",
)


def _batch(lens, hq, hkv, d, seed):
    """q (N, hq, d), k and v (N, hkv, d) in bf16, as views into one fused QKV projection."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


def _reference(q, k, v, start, n, scale, cap=None):
    """Causal attention of the rows start .. start + n in float64, GQA by repetition (the
    scores soft-capped where ``cap``: ``_paged_reference``)."""
    rows = slice(start, start + n)
    if cap is not None:
        table = torch.arange(n)  # NOTE: the rows as a cache of one-position blocks
        caches = (t[rows].unsqueeze(1) for t in (k, v))
        return _paged_reference(q, *caches, table, start, n, n, scale, cap=cap)
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = (t[rows].transpose(0, 1).double() for t in (q, k, v))
    ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    return out.transpose(0, 1)


def _check(out, ref, v):
    """SDPA's bound for bf16 (``test_tiled_prefill``): the probabilities are rounded to bf16
    before multiplying V, so 2^-8 * max|v| + 2^-8 * |ref|."""
    err = (out.double() - ref).abs()
    bound = 2**-8 * v.abs().max().double() + 2**-8 * ref.abs()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 256), (2, 2, 96)])
def test_flash_prefill_against_float64(hq, hkv, d):
    """Every head size the kernel takes (the accumulator in tiles up to 64, in memory above),
    lengths across the 16-token items and 32-position blocks; rows of a sequence not named
    (the second) are left as they were."""
    assert attention.flash_prefill(torch.empty(1, hq, d, dtype=torch.bfloat16))
    lens = [1, 40, 5, 16, 17, 33, 100]
    q, k, v, starts = _batch(lens, hq, hkv, d, seed=d)
    named = [i for i in range(len(lens)) if i != 1]
    out = torch.full_like(q, 7.0)
    scale = d**-0.5
    attention.causal_prefill(
        q, k, v, out, [starts[i] for i in named], [lens[i] for i in named], scale
    )
    for i in named:
        rows = slice(starts[i], starts[i] + lens[i])
        _check(out[rows], _reference(q, k, v, starts[i], lens[i], scale), v[rows])
    assert (out[starts[1] : starts[1] + lens[1]] == 7.0).all()


def test_flash_prefill_wants_each_tokens_heads_contiguous():
    q, k, _, _ = _batch([8], 4, 2, 64, seed=1)
    assert attention.flash_prefill(q, k)
    assert not attention.flash_prefill(q, k.transpose(1, 2).contiguous().transpose(1, 2))
    assert not attention.flash_prefill(q.float())
    assert not attention.flash_prefill(q[..., :48])


def test_flash_prefill_when_the_running_max_moves():
    """Scores that grow along the positions (each 32-position block's max far above the last,
    by hundreds at the end: without moving the running max and rescaling the accumulator,
    exp overflows float32) and a first position far above the rest (it never moves again):
    both within the bound."""
    n, d = 160, 64
    q, k, v, _ = _batch([n], 4, 2, d, seed=7)
    ramp = torch.linspace(0.2, 20.0, n)[:, None, None]
    for keys in (k.float() * ramp, torch.cat([k[:1].float() * 8, k[1:].float()])):
        keys = keys.to(torch.bfloat16)
        out = torch.empty_like(q)
        attention.causal_prefill(q, keys, v, out, [0], [n], 1.0)
        _check(out, _reference(q, keys, v, 0, n, 1.0), v)


def test_flash_prefill_same_bits_lent_a_helper_or_not():
    from tests.helpers import lent_a_helper

    lens = [130, 7, 64, 300]
    q, k, v, starts = _batch(lens, 9, 3, 64, seed=3)

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        attention.causal_prefill(q, k, v, out, starts, lens, 0.125)
        return out

    alone = run()
    lent_a_helper(lambda: torch.testing.assert_close(run(), alone, rtol=0, atol=0))


def _cache(ctxs, hkv, d, bs, seed):
    """Caches holding each sequence's ctx positions in blocks of a random order (spare blocks
    NaN: a kernel reading one fails), and the tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctxs]
    blocks = sum(need) + 3
    kc, vc = (torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16) for _ in "kv")
    ids = torch.randperm(blocks, generator=g)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n].clone())
        at += n
    for spare in ids[at:]:
        kc[spare], vc[spare] = float("nan"), float("nan")
    return kc, vc, tables


def _paged_reference(
    q, kc, vc, table, start, n, ctx, scale, window=None, sinks=None, cap=None, chunk=None
):
    """The chunk's rows (the last n of ctx positions) in float64 over the gathered K/V: each
    row sees the positions up to its own (the last ``window`` of them; none before its
    ``chunk``'s first, ``own - own % chunk``, Llama 4's chunked attention), ``sinks`` (one logit
    per query head) join each row's softmax without a value, and the scores are capped to
    ``cap * tanh(score / cap)`` first where ``cap`` (Gemma 2's soft-capping)."""
    hkv, d = kc.shape[2], kc.shape[3]
    ks, vs = (c[table].reshape(-1, hkv, d)[:ctx].transpose(0, 1).double() for c in (kc, vc))
    group = q.shape[1] // hkv
    ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
    qs = q[start : start + n].transpose(0, 1).double()
    pos, own = torch.arange(ctx)[None, :], torch.arange(ctx - n, ctx)[:, None]
    seen = (pos <= own) & ((pos > own - window) if window else True)
    if chunk:
        seen &= pos >= own - own % chunk
    scores = qs @ ks.transpose(1, 2) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(-1, n, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ vs).transpose(0, 1)


def test_flash_prefill_with_a_window_and_sinks():
    """Sliding windows (shorter than a block, a block, past several) and sinks, fresh and over
    cached context, against float64; without the flash kernel a window is refused."""
    ctxs, lens, bs, d = [300, 100, 64], [300, 37, 64], 16, 64
    kc, vc, tables = _cache(ctxs, 2, d, bs, seed=11)
    q, _, _, starts = _batch(lens, 6, 2, d, seed=12)
    seqs = _seqs(starts, lens, ctxs, tables)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(13)) * 2
    for window, sink in ((7, None), (32, sinks), (100, None), (None, sinks)):
        out = torch.empty_like(q)
        assert attention.paged_prefill(q, kc, vc, out, seqs, 0.125, window, sink)
        for i, s in enumerate(seqs):
            rows = slice(s.query_start, s.query_start + s.query_len)
            ref = _paged_reference(
                q, kc, vc, tables[i], s.query_start, s.query_len, s.context_len, 0.125, window, sink
            )
            _check(out[rows], ref, vc[tables[i]])
    fresh = q[:64], *(c[tables[2]].reshape(-1, 2, d)[:64] for c in (kc, vc))
    out = torch.empty_like(fresh[0])
    attention.causal_prefill(*fresh, out, [0], [64], 0.125, 20, sinks)
    ref = _paged_reference(fresh[0], kc, vc, tables[2], 0, 64, 64, 0.125, 20, sinks)
    _check(out, ref, fresh[2])
    torch.ops.warmboot_cpu.use_amx(False)
    try:
        with pytest.raises(RuntimeError, match="a window, sinks or a softcap need the flash"):
            attention.causal_prefill(*fresh, out, [0], [64], 0.125, 20)
        assert not attention.paged_prefill(q, kc, vc, torch.empty_like(q), seqs, 0.125, 7)
    finally:
        torch.ops.warmboot_cpu.use_amx(True)


def test_flash_prefill_with_chunks():
    """Chunked local attention: chunks shorter than a 32-position block, of one, and longer
    (not aligned to blocks), their boundaries inside a chunk's rows and across its cached
    context, with a window (the later first position) and sinks too; fresh and over cached
    context, against float64, whose chunk-free answer differs; without the flash kernel
    chunks are refused."""
    ctxs, lens, bs, d = [300, 100, 64], [300, 37, 64], 16, 64
    kc, vc, tables = _cache(ctxs, 2, d, bs, seed=31)
    q, _, _, starts = _batch(lens, 6, 2, d, seed=32)
    seqs = _seqs(starts, lens, ctxs, tables)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(33)) * 2
    cases = ((8, None, None), (32, None, sinks), (48, 20, None), (100, 70, sinks))
    for chunk, window, sink in cases:
        out, change = torch.empty_like(q), 0.0
        assert attention.paged_prefill(q, kc, vc, out, seqs, 0.125, window, sink, None, chunk)
        for i, s in enumerate(seqs):
            rows = slice(s.query_start, s.query_start + s.query_len)
            at = (q, kc, vc, tables[i], s.query_start, s.query_len, s.context_len, 0.125, window)
            ref = _paged_reference(*at, sink, chunk=chunk)
            _check(out[rows], ref, vc[tables[i]])
            change = max(change, (ref - _paged_reference(*at, sink)).abs().max())
        assert change > 0.05, "chunks this test can tell from none"
    fresh = q[:64], *(c[tables[2]].reshape(-1, 2, d)[:64] for c in (kc, vc))
    out = torch.empty_like(fresh[0])
    attention.causal_prefill(*fresh, out, [0], [64], 0.125, None, None, None, 24)
    ref = _paged_reference(fresh[0], kc, vc, tables[2], 0, 64, 64, 0.125, chunk=24)
    _check(out, ref, fresh[2])
    torch.ops.warmboot_cpu.use_amx(False)
    try:
        with pytest.raises(RuntimeError, match="and so do chunks"):
            attention.causal_prefill(*fresh, out, [0], [64], 0.125, None, None, None, 24)
    finally:
        torch.ops.warmboot_cpu.use_amx(True)


def test_flash_prefill_with_soft_capped_scores():
    """Scores capped to ``cap * tanh(score / cap)`` (a cap that flattens them and Gemma 2's 50),
    fresh and over cached context, with a window too, against float64; without the flash
    kernel a softcap is refused (fresh) or declined (cached)."""
    ctxs, lens, bs, d = [200, 90], [200, 30], 16, 64
    kc, vc, tables = _cache(ctxs, 2, d, bs, seed=21)
    q, _, _, starts = _batch(lens, 4, 2, d, seed=22)
    seqs = _seqs(starts, lens, ctxs, tables)
    for cap, window in ((2.0, None), (50.0, None), (5.0, 40)):
        out = torch.empty_like(q)
        assert attention.paged_prefill(q, kc, vc, out, seqs, 1.0, window, None, cap)
        for i, s in enumerate(seqs):
            rows = slice(s.query_start, s.query_start + s.query_len)
            at = (q, kc, vc, tables[i], s.query_start, s.query_len, s.context_len, 1.0, window)
            ref = _paged_reference(*at, cap=cap)
            _check(out[rows], ref, vc[tables[i]])
        first = (q, kc, vc, tables[0], 0, 200, 200, 1.0, window)
        change = (_paged_reference(*first) - _paged_reference(*first, None, cap)).abs().max()
        assert cap == 50.0 or change > 0.05, "a cap this test can tell from none"
    fresh = q[:64], *(c[tables[0]].reshape(-1, 2, d)[:64] for c in (kc, vc))
    out = torch.empty_like(fresh[0])
    attention.causal_prefill(*fresh, out, [0], [64], 1.0, None, None, 2.0)
    _check(out, _paged_reference(fresh[0], kc, vc, tables[0], 0, 64, 64, 1.0, cap=2.0), fresh[2])
    torch.ops.warmboot_cpu.use_amx(False)
    try:
        with pytest.raises(RuntimeError, match="a window, sinks or a softcap need the flash"):
            attention.causal_prefill(*fresh, out, [0], [64], 1.0, None, None, 2.0)
        assert not attention.paged_prefill(
            q, kc, vc, torch.empty_like(q), seqs, 1.0, None, None, 2.0
        )
    finally:
        torch.ops.warmboot_cpu.use_amx(True)
    with pytest.raises(RuntimeError, match="softcap must be 0 \\(none\\) or positive"):
        attention.causal_prefill(*fresh, out, [0], [64], 1.0, None, None, -1.0)


@pytest.mark.parametrize("d", [64, 128])
def test_paged_prefill_against_float64(d):
    """Chunks over cached context (a prefix-cache hit, a chunked prefill's later chunk, one
    token, one fresh chunk), K/V read from blocks in a random order; rows not named (the
    last chunk's) left as they were; NaN spare blocks never read."""
    ctxs, lens, bs = [40, 200, 1000, 33, 50], [40, 17, 128, 1, 9], 16
    kc, vc, tables = _cache(ctxs, 2, d, bs, seed=d)
    q, _, _, starts = _batch(lens, 8, 2, d, seed=d + 1)
    out = torch.full_like(q, 7.0)
    scale = d**-0.5
    assert attention.paged_prefill(q, kc, vc, out, _seqs(starts, lens, ctxs, tables)[:4], scale)
    for i in range(4):
        rows = slice(starts[i], starts[i] + lens[i])
        ref = _paged_reference(q, kc, vc, tables[i], starts[i], lens[i], ctxs[i], scale)
        _check(out[rows], ref, vc[tables[i]])
    assert (out[starts[4] :] == 7.0).all()


def _seqs(starts, lens, ctxs, tables):
    from warmboot.kernels.backend import PrefillSeq

    return [PrefillSeq(*a) for a in zip(starts, lens, ctxs, tables, strict=True)]


def test_paged_prefill_refuses_bad_tables_and_declines_what_it_cannot_take():
    kc, vc, tables = _cache([40], 2, 64, 16, seed=1)
    q, _, _, _ = _batch([8], 8, 2, 64, seed=2)
    out = torch.full_like(q, 7.0)
    bad = [torch.tensor([0, 1, kc.shape[0]])]
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention.paged_prefill(q, kc, vc, out, _seqs([0], [8], [40], bad), 0.125)
    with pytest.raises(RuntimeError, match="3 blocks or more"):
        attention.paged_prefill(q, kc, vc, out, _seqs([0], [8], [40], [tables[0][:2]]), 0.125)
    with pytest.raises(RuntimeError, match="outside the 8 tokens or its context"):
        attention.paged_prefill(q, kc, vc, out, _seqs([0], [8], [5], tables), 0.125)
    q32, out32 = q.float(), out.float()
    assert not attention.paged_prefill(q32, kc, vc, out32, _seqs([0], [8], [40], tables), 0.125)
    assert (out32 == 7.0).all()


@pytest.mark.parametrize("cap", [None, 3.0])
def test_backend_runs_every_prefill_through_the_flash_kernel(monkeypatch, cap):
    """On AMX the fresh bf16 prefills, short ones too, go through one ``causal_prefill`` call
    and those over cached context through one ``paged_prefill`` call, soft-capped scores
    (Gemma 2) too; nothing is left to the per-sequence path."""
    from tests.helpers import prefill_meta
    from warmboot.kernels.torch_attention import TorchAttentionBackend

    lens, ctx = [64, 20, 3, 70], [64, 20, 3, 90]
    kc, vc, tables = _cache(ctx, 3, 64, 16, seed=4)
    q, k, v, starts = _batch(lens, 9, 3, 64, seed=2)
    seqs = _seqs(starts, lens, ctx, tables)
    calls = []
    for name in ("causal_prefill", "paged_prefill"):
        real = getattr(attention, name)
        monkeypatch.setattr(
            attention, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a)
        )
    backend = TorchAttentionBackend(native_kernels=True)
    monkeypatch.setattr(backend, "_prefill", lambda *a: pytest.fail("a per-sequence prefill ran"))
    monkeypatch.setattr(attention, "write_kv", lambda *a: True)  # NOTE: the caches as built
    meta = prefill_meta(seqs, sum(lens))
    out = backend.forward(q, k, v, kc, vc, meta, 0.125, None, cap)
    assert calls == ["causal_prefill", "paged_prefill"]
    for s, n in zip(starts[:3], lens[:3], strict=True):
        _check(out[s : s + n], _reference(q, k, v, s, n, 0.125, cap), v[s : s + n])
    ref = _paged_reference(q, kc, vc, tables[3], starts[3], lens[3], ctx[3], 0.125, cap=cap)
    _check(out[starts[3] :], ref, vc[tables[3]])
