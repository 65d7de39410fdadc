"""Paged decode attention (flash-decoding) in Triton.

One or a few new query tokens per sequence (decode; speculative-decoding verification)
against a paged KV cache ``(num_blocks, block_size, Hkv, D)``:

- ``query_len`` tokens per sequence, contiguous in ``q (batch * query_len, Hq, D)``; token i
  of sequence b sits at key position ``seqused_k[b] - query_len + i`` (bottom-right aligned,
  causal), so ``seqused_k`` counts the new tokens' keys too;
- grid ``(split, kv head, sequence)``: each program takes the ``query_len * Hq / Hkv`` rows
  (token x query head) of its KV head (GQA packing: K/V read once per group) and a contiguous
  share of the keys visible to some row; the rows form one tile, so longer queries belong to
  ``flash_attn_varlen_func`` (which reads the same paged cache);
- only the last ``query_len - 1`` keys (and as many at a sliding window's left edge) need a
  per-row mask: with ``query_len == 1`` (a constant: Triton specialises 1) those loops vanish;
- split-K: with ``num_splits > 1`` programs write fp32 partial outputs and log-sum-exps and
  a combine kernel merges them; with one split the kernel writes the output directly;
- keys are addressed through the block table per key, so any power-of-two block size works;
- sliding window (``window_size[0]`` keys to the left of each query; ``window_size[1]`` must
  be -1 or 0), chunks (``chunk``: no key before ``pos - pos % chunk``, as the varlen kernel),
  tanh softcap and attention sinks (added after the keys, in the combine with splits).

No host synchronisation and no data-dependent Python: the launch depends only on shapes, so
it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmboot.kernels import tuning
from warmboot.kernels.attention import (
    LOG2E,
    _attn_blocks,
    add_sink,
    check_sinks,
    chunk_bounds,
    first_key,
)


@triton.jit
def _regions(first, seq_len, window_left, chunk, HAS_LEFT: tl.constexpr):
    """Keys of query positions [first, seq_len): visible to some row from ``lo``; to every
    row in [full_lo, full_hi); [lo, full_lo) and [full_hi, seq_len) need a per-row mask."""
    lo = 0
    full_lo = 0
    if HAS_LEFT:
        lo = tl.maximum(first_key(first, window_left, chunk), 0)
        full_lo = tl.maximum(first_key(seq_len - 1, window_left, chunk), 0)
    full_hi = tl.maximum(first + 1, full_lo)
    return lo, full_lo, full_hi


@triton.jit
def _keys(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    b,
    pos_m,
    lo,
    hi,
    BLOCK_TABLE,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    cap_log2,
    window_left,
    chunk,
    tau,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Keys [lo, hi) of sequence b (none when lo >= hi); LEFT / RIGHT: per-row window and
    causal masks at the rows' positions ``pos_m``."""
    return _attn_blocks(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        b,
        0,
        hi,
        pos_m,
        lo,
        hi,
        BLOCK_TABLE,
        stride_bt,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        qk_scale,
        cap_log2,
        window_left,
        0,
        chunk,
        tau,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        True,
        LEFT,
        RIGHT,
        SOFTCAP,
        0,
        True,
        PAGE_SIZE,
        DOT_FP32,
        NUM_STAGES,
        False,
        INTERPRET,
    )


# NOTE: the table width (eager steps), the split count and the partials' strides change from
# step to step; specialising them (== 1, % 16) would JIT-compile new variants while serving.
@triton.jit(do_not_specialize=["stride_bt", "stride_pt", "stride_ph", "num_splits", "query_len"])
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    OPart,
    LPart,
    BLOCK_TABLE,
    SEQ_LENS,
    SINKS,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    qk_scale,
    cap_log2,
    window_left,
    chunk,
    tau,
    num_splits,
    query_len,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """BLOCK_G >= query_len * GROUP rows: row r is token r // GROUP, head r % GROUP."""
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    first = seq_len - query_len  # position of the sequence's first new token
    lo, full_lo, full_hi = _regions(first, seq_len, window_left, chunk, HAS_LEFT)
    share = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, seq_len)
    offs_r = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < query_len * GROUP
    d_ok = offs_d < HEAD_DIM
    row0 = b.to(tl.int64) * query_len  # the sequence's first row of q / out (int64 scalar)
    t = tl.minimum(offs_r // GROUP, query_len - 1)  # token; a constant 0 with one token
    heads = kvh * GROUP + offs_r - t * GROUP  # padding rows: beyond the group, masked
    pos_m = first + t
    q = tl.load(
        Q + row0 * stride_qt + (t * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    Kh = K + kvh * stride_kh
    Vh = V + kvh * stride_vh
    f_lo = start  # keys [f_lo, f_hi) need no per-row mask: all of them with one token
    f_hi = end
    if query_len > 1:  # keys at the window's left edge (at most query_len - 1)
        f_lo = tl.maximum(start, full_lo)
        f_hi = tl.minimum(end, full_hi)
        acc, m_i, l_i = _keys(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            b,
            pos_m,
            start,
            tl.minimum(end, full_lo),
            BLOCK_TABLE,
            stride_bt,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            cap_log2,
            window_left,
            chunk,
            tau,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            PAGE_SIZE,
            HAS_LEFT,
            True,
            SOFTCAP,
            DOT_FP32,
            1,
            INTERPRET,
        )
    acc, m_i, l_i = _keys(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        b,
        pos_m,
        f_lo,
        f_hi,
        BLOCK_TABLE,
        stride_bt,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        qk_scale,
        cap_log2,
        window_left,
        chunk,
        tau,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        PAGE_SIZE,
        False,
        False,
        SOFTCAP,
        DOT_FP32,
        NUM_STAGES,
        INTERPRET,
    )
    if query_len > 1:  # the new tokens' own keys (query_len - 1): causal
        acc, m_i, l_i = _keys(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            b,
            pos_m,
            tl.maximum(start, full_hi),
            end,
            BLOCK_TABLE,
            stride_bt,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            cap_log2,
            window_left,
            chunk,
            tau,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            PAGE_SIZE,
            HAS_LEFT,
            True,
            SOFTCAP,
            DOT_FP32,
            1,
            INTERPRET,
        )
    if HAS_SINKS and not SPLIT:  # NOTE: with splits the combine adds the sink
        sink = tl.load(SINKS + heads, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink)
    empty = l_i == 0.0  # no visible key in this split: output 0, LSE -inf (weight 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    rd_ok = r_ok[:, None] & d_ok[None, :]
    base = row0 * stride_pt + t * stride_pt + heads * stride_ph  # (BLOCK_G,)
    if SPLIT:
        tl.store(OPart + ((base + split) * BLOCK_D)[:, None] + offs_d[None, :], out, mask=rd_ok)
        tl.store(LPart + base + split, lse2, mask=r_ok)
    else:
        o_ptr = Out + row0 * stride_ot + (t * stride_ot + heads * stride_oh)[:, None]
        o_ptr += offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=rd_ok)
        tl.store(LPart + base, lse2, mask=r_ok)


@triton.jit(do_not_specialize=["stride_pt", "stride_ph", "num_splits"])
def _combine_kernel(
    Out,
    OPart,
    LPart,
    SINKS,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out = sum_s 2^(lse_s - lse) * o_s over the splits of one (query token, head); a sink
    joins the denominator (lse) only."""
    h = tl.program_id(0)
    t = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = t.to(tl.int64) * stride_pt + h * stride_ph
    lse = tl.load(LPart + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # (BLOCK_S,); 0 for empty splits
    o = tl.load(
        OPart + ((base + offs_s) * BLOCK_D)[:, None] + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    o_ptr = Out + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    lse_all = tl.where(total == 0.0, float("-inf"), m_safe + tl.log2(tl.maximum(total, 1e-30)))
    tl.store(LPart + base, lse_all)  # slot 0 of the row now holds the total


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_inputs(q, k_cache, v_cache, block_table, seqused_k) -> None:
    _check(q.dim() == 3, f"q must be (batch * query_len, Hq, D), got {tuple(q.shape)}")
    _check(k_cache.dim() == 4, "k_cache must be (num_blocks, block_size, Hkv, D)")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    _check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {q.dtype}")
    _check(k_cache.dtype == v_cache.dtype == q.dtype, "q and the caches must share a dtype")
    _check(
        q.device == k_cache.device == v_cache.device == block_table.device == seqused_k.device,
        "q, the caches, block_table and seqused_k must be on one device",
    )
    _, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    _check(dk == d and d <= 256, f"head dim {d} (cache {dk}): must match, at most 256")
    _check(hkv > 0 and hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}")
    _check(bs > 0 and bs & (bs - 1) == 0, f"block size {bs} must be a power of two")
    _check(
        q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
        "q and the caches need a unit stride on the head dim",
    )
    _check(
        block_table.dim() == 2 and block_table.dtype in (torch.int32, torch.int64),
        "block_table must be (batch, max_blocks) int32/int64",
    )
    batch = block_table.shape[0]
    _check(
        seqused_k.shape == (batch,) and not seqused_k.is_floating_point(),
        f"seqused_k must be ({batch},) int, one length per block_table row",
    )


def _check_call(q, batch, query_len, window_size, out) -> None:
    _check(
        isinstance(query_len, int) and query_len >= 1, f"query_len must be an int >= 1: {query_len}"
    )
    _check(
        q.shape[0] == batch * query_len,
        f"q has {q.shape[0]} rows; expected batch * query_len = {batch} * {query_len}",
    )
    _check(window_size[1] in (-1, 0), f"decode is causal: window_size[1] {window_size[1]}")
    _check(
        out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1),
        "out must match q's shape and dtype with a unit last stride",
    )


def default_num_splits(batch: int, hkv: int, max_len: int, device: torch.device) -> int:
    """Enough programs for about two waves on a GPU; few in the interpreter."""
    blocks = max(1, triton.cdiv(max_len, 64))
    if device.type != "cuda" or tuning.interpreting():
        return min(blocks, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, 64, triton.cdiv(2 * sms, batch * hkv)))


def paged_decode_attention(
    q: torch.Tensor,  # (batch * query_len, Hq, D), a sequence's tokens contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (batch, max_blocks) int32/int64
    seqused_k: torch.Tensor,  # (batch,) keys per sequence, the new tokens' included
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int | None = None,
    return_lse: bool = False,
    *,
    query_len: int = 1,
    tau: float = 8.0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out like q [, lse (Hq, batch * query_len) fp32 natural]; token i of sequence b sits at
    key position ``seqused_k[b] - query_len + i`` (causal; a row without keys gives 0, -inf).
    ``sinks``: (Hq,) logits (natural units) in every row's denominator, no value. ``chunk``:
    a token at ``pos`` sees no key before ``pos - pos % chunk``."""
    _check_inputs(q, k_cache, v_cache, block_table, seqused_k)
    check_sinks(sinks, q)
    batch = block_table.shape[0]
    _check_call(q, batch, query_len, window_size, out)
    rows, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    if num_splits is None:
        num_splits = default_num_splits(batch, hkv, block_table.shape[1] * bs, q.device)
    _check(num_splits >= 1, "num_splits must be >= 1")
    if out is None:
        out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(d))
    split = num_splits > 1
    f32 = dict(dtype=torch.float32, device=q.device)
    o_part = torch.empty((rows, hq, num_splits, block_d) if split else (1,), **f32)
    l_part = torch.empty((rows, hq, num_splits), **f32)
    left, chunk = chunk_bounds(window_size[0], chunk)
    if rows:
        _launch(
            q,
            k_cache,
            v_cache,
            out,
            o_part,
            l_part,
            block_table,
            seqused_k,
            sinks,
            scale,
            (left, chunk),
            softcap,
            tau,
            num_splits,
            query_len,
            block_d,
        )
    if not return_lse:
        return out
    return out, (l_part[:, :, 0] / LOG2E).transpose(0, 1)


def _launch(
    q,
    k_cache,
    v_cache,
    out,
    o_part,
    l_part,
    table,
    seqlens,
    sinks,
    scale,
    bounds,
    softcap,
    tau,
    num_splits,
    query_len,
    block_d,
) -> None:
    """``bounds``: the left window and the chunk as ``chunk_bounds`` gives them."""
    rows, hq, d = q.shape
    left, chunk = bounds
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    interp = tuning.interpreting()
    if softcap > 0:
        qk_scale, cap_log2 = 2.0 * scale / softcap * LOG2E, softcap * LOG2E
    else:
        qk_scale, cap_log2 = scale * LOG2E, 0.0
    block_n = 16 if interp else (32 if d > 128 else 64)
    sink_ptr = l_part if sinks is None else sinks  # NOTE: never read without sinks
    _decode_kernel[(num_splits, hkv, table.shape[0])](
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        l_part,
        table,
        seqlens,
        sink_ptr,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        table.stride(0),
        out.stride(0),
        out.stride(1),
        l_part.stride(0),
        l_part.stride(1),
        qk_scale,
        cap_log2,
        left,
        chunk,
        float(tau),
        num_splits,
        query_len,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(query_len * group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE_SIZE=bs,
        HAS_LEFT=left >= 0,
        SOFTCAP=softcap > 0,
        SPLIT=num_splits > 1,
        DOT_FP32=interp and q.dtype == torch.bfloat16,
        NUM_STAGES=1 if interp else 3,
        INTERPRET=interp,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _combine_kernel[(hq, rows)](
            out,
            o_part,
            l_part,
            sink_ptr,
            out.stride(0),
            out.stride(1),
            l_part.stride(0),
            l_part.stride(1),
            num_splits,
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
