"""``csrc/causal_prefill.cpp``'s flash kernel on AMX tiles (bfloat16 fresh prefills): each row
against a float64 reference, every head size and GQA group it takes, odd lengths, a running
max that moves (the lazy rescale), the same bits lent a helper or not, and the backend's
routing. Skipped where the tiles are not usable (an AMD EPYC, gVisor)."""

from __future__ import annotations

import pytest
import torch

from warmboot.kernels import native
from warmboot.kernels.native import attention

pytestmark = pytest.mark.skipif(
    native.library() is None or not native.amx(),
    reason="the flash kernel needs the native library and AMX tiles (CPU flags, OS permission)",
)


def _batch(lens, hq, hkv, d, seed, fused=True):
    """q (N, hq, d), k and v (N, hkv, d) in bf16, as views into one fused QKV projection."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


def _reference(q, k, v, start, n, scale):
    """Causal attention of the rows start .. start + n in float64, GQA by repetition."""
    rows = slice(start, start + n)
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
    attention.causal_prefill(q, k, v, out, [starts[i] for i in named], [lens[i] for i in named],
                             scale)  # fmt: skip
    for i in named:
        rows = slice(starts[i], starts[i] + lens[i])
        _check(out[rows], _reference(q, k, v, starts[i], lens[i], scale), v[rows])
    assert (out[starts[1] : starts[1] + lens[1]] == 7.0).all()


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


def test_backend_runs_every_fresh_prefill_through_the_flash_kernel(monkeypatch):
    """On AMX every fresh bf16 prefill, short ones too, goes through one ``causal_prefill``
    call; one over cached context takes the per-sequence path."""
    from warmboot.kernels.backend import AttentionMetadata, PrefillSeq
    from warmboot.kernels.torch_attention import TorchAttentionBackend

    lens, ctx = [64, 20, 3, 70], [64, 20, 3, 90]
    q, k, v, starts = _batch(lens, 9, 3, 64, seed=2)
    seqs = [PrefillSeq(s, n, c, torch.zeros(8, dtype=torch.long))
            for s, n, c in zip(starts, lens, ctx, strict=True)]  # fmt: skip
    calls, others = [], []
    real = attention.causal_prefill
    monkeypatch.setattr(attention, "causal_prefill", lambda *a: calls.append(a[4:6]) or real(*a))
    backend = TorchAttentionBackend(native_kernels=True)
    monkeypatch.setattr(backend, "_prefill", lambda q, *a: others.append(a[-5]) or q)
    monkeypatch.setattr(attention, "write_kv", lambda *a: True)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(lens), dtype=torch.long),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        prefills=seqs,
        block_size=16,
    )
    out = backend.forward(q, k, v, None, None, meta, 0.125, None)
    assert calls == [(starts[:3], lens[:3])] and others == [seqs[3]]
    for s, n in zip(starts[:3], lens[:3], strict=True):
        _check(out[s : s + n], _reference(q, k, v, s, n, 0.125), v[s : s + n])
