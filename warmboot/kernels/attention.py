"""Varlen flash-attention forward in Triton with FlashAttention-4's algorithmic ideas.

- Online softmax in base 2 with **conditional rescaling**: a key block that raises a row's
  max by at most ``tau`` (log2 units) keeps the old max, so O and l are not rescaled; the
  final normalisation and LSE use the same max, so the result is exact.
- **exp2 emulation**: a power-of-two fraction of each score tile's columns goes through
  ``exp2_emulated`` (FMA units), the rest through the hardware exp2.
- **Pipelining**: K/V loads software-pipelined by ``tl.range(num_stages=...)``; warp
  specialisation where the Triton and the GPU support it (a tuning candidate).
- **LPT order**: one linear grid; the last (longest) query blocks of the longest sequences
  start first, heads innermost so consecutive programs share K/V, heads cut into sections
  whose K/V fit in L2. ``lpt=False`` is the plain order (query block fastest).

K/V come either packed (``cu_seqlens_k``) or from a paged cache (``block_table`` +
``seqused_k``, any block size), which the engine uses for prefill over cached context.

Chunked local attention (Llama 4's, ``chunk``): a query at ``pos`` sees no key before
``pos - pos % chunk``; it joins the left window's bound (the later of the two), so the kernels
carry a window of ``NO_WINDOW`` where only a chunk bounds the keys, and a chunk of
``NO_CHUNK`` where only a window does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmboot.kernels import tuning
from warmboot.kernels.exp2 import exp2_emulated

LOG2E = 1.4426950408889634
L2_BUDGET = 50 * 2**20
"""Bytes of K+V per head section (FA-4's figure) that consecutive programs share via L2."""
HEAD_DIMS = (64, 96, 128, 256)
"""Head dims tuned and benchmarked; any head dim <= 256 works (padded to a power of two)."""
NO_WINDOW = 1 << 30
"""The left window the kernels take where a chunk alone bounds the keys (none reaches it)."""
NO_CHUNK = 1 << 30
"""The chunk the kernels take where none is set: every position lies in chunk 0."""


# ----------------------------------------------------------------------------- device code
@triton.jit
def _mix2(x):
    """exp2 of a (M, N) tile: even columns on the hardware, odd ones emulated (1/2)."""
    m: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (m, n // 2, 2)))
    return tl.reshape(tl.join(tl.exp2(a), exp2_emulated(b)), (m, n))


@triton.jit
def _mix4(x):
    m: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (m, n // 2, 2)))
    return tl.reshape(tl.join(tl.exp2(a), _mix2(b)), (m, n))


@triton.jit
def _mix8(x):
    m: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (m, n // 2, 2)))
    return tl.reshape(tl.join(tl.exp2(a), _mix4(b)), (m, n))


@triton.jit
def exp2_mixed(x, EMU_DIV: tl.constexpr):
    """2^x with 1/EMU_DIV of the columns emulated (EMU_DIV 0: none, 1: all, 2/4/8)."""
    if EMU_DIV == 0:
        y = tl.exp2(x)
    elif EMU_DIV == 1:
        y = exp2_emulated(x)
    elif EMU_DIV == 2:
        y = _mix2(x)
    elif EMU_DIV == 4:
        y = _mix4(x)
    else:
        y = _mix8(x)
    return y


@triton.jit
def scores_log2(s, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Raw q.k -> scores in log2 units; with softcap ``cap*tanh(s*scale/cap)*log2(e)``.

    ``qk_scale`` is ``scale*log2(e)`` without softcap and ``2*scale/cap*log2(e)`` with it."""
    if SOFTCAP:
        t = tl.exp2(s * qk_scale)  # e^(2x), x = s * scale / cap
        s = cap_log2 * (1.0 - 2.0 / (t + 1.0))
    else:
        s = s * qk_scale
    return s


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, tau, EMU_DIV: tl.constexpr):
    """One key block of the online softmax with conditional rescaling; p in fp32."""
    m_cand = tl.maximum(m_i, tl.max(s, 1))
    m_new = tl.where(m_cand > m_i + tau, m_cand, m_i)  # NOTE: keep a stale max within tau
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
    if tl.max((m_new > m_i).to(tl.int32), 0) > 0:  # some row moved: rescale
        alpha = tl.exp2(m_i - m_safe)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
    p = exp2_mixed(s - m_safe[:, None], EMU_DIV)
    l_i = l_i + tl.sum(p, 1)
    return p, m_new, l_i, acc


@triton.jit
def add_sink(acc, m_i, l_i, sink):
    """Join a sink logit (log2 units, per row or one) to each row's softmax denominator:
    it raises the max and the sum but contributes no value (GPT-OSS's attention sinks)."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha + tl.exp2(sink - m_safe)
    return acc, m_new, l_i


@triton.jit
def first_key(pos, window_left, chunk):
    """The first key a query at ``pos`` sees (``HAS_LEFT``): its window's, or its chunk's
    where later; below 0 where neither bounds it."""
    return tl.maximum(pos - window_left, pos - pos % chunk)


@triton.jit
def kv_offsets(
    offs_n,
    b,
    k_start,
    BLOCK_TABLE,
    stride_bt,
    stride_kb,
    stride_kt,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    valid,
):
    """Element offsets (int64) of the K/V rows of key positions ``offs_n`` of sequence b."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + b * stride_bt + offs_n // PAGE_SIZE, mask=valid, other=0)
        rows = page.to(tl.int64) * stride_kb + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kt
    else:
        rows = (k_start + offs_n).to(tl.int64) * stride_kt
    return rows


@triton.jit
def _attn_block(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    n,
    b,
    k_start,
    k_len,
    pos_m,
    BLOCK_TABLE,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    cap_log2,
    window_left,
    window_right,
    chunk,
    tau,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMU_DIV: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The key block at n: scores, mask, online softmax, P @ V."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k_len
    k_rows = kv_offsets(
        offs_n, b, k_start, BLOCK_TABLE, stride_bt, stride_kb, stride_kt, PAGED, PAGE_SIZE, n_ok
    )
    kt = tl.load(
        K + k_rows[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0
    )  # (BLOCK_D, BLOCK_N)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
    else:
        s = tl.dot(q, kt)
    s = scores_log2(s, qk_scale, cap_log2, SOFTCAP)
    if MASKED:
        ok = n_ok[None, :]
        if HAS_LEFT:
            ok = ok & (offs_n[None, :] >= first_key(pos_m, window_left, chunk)[:, None])
        if HAS_RIGHT:
            ok = ok & (offs_n[None, :] <= pos_m[:, None] + window_right)
        s = tl.where(ok, s, float("-inf"))
    p, m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, tau, EMU_DIV)
    v_rows = kv_offsets(
        offs_n, b, k_start, BLOCK_TABLE, stride_bt, stride_vb, stride_vt, PAGED, PAGE_SIZE, n_ok
    )
    v = tl.load(
        V + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
    )  # (BLOCK_N, BLOCK_D)
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _attn_blocks(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    b,
    k_start,
    k_len,
    pos_m,
    start,
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
    window_right,
    chunk,
    tau,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMU_DIV: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Key blocks [start, end): K and V already offset to the KV head.

    NOTE: the interpreter walks a ``while`` loop: Triton 3.6's interpreted ``tl.range``
    converts its 1-element bounds with ``int()``, which numpy >= 2.4 refuses."""
    if INTERPRET:
        n = start
        while n < end:
            acc, m_i, l_i = _attn_block(
                acc,
                m_i,
                l_i,
                q,
                K,
                V,
                n,
                b,
                k_start,
                k_len,
                pos_m,
                BLOCK_TABLE,
                stride_bt,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                qk_scale,
                cap_log2,
                window_left,
                window_right,
                chunk,
                tau,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                MASKED,
                HAS_LEFT,
                HAS_RIGHT,
                SOFTCAP,
                EMU_DIV,
                PAGED,
                PAGE_SIZE,
                DOT_FP32,
            )
            n += BLOCK_N
    else:
        for n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
            acc, m_i, l_i = _attn_block(
                acc,
                m_i,
                l_i,
                q,
                K,
                V,
                n,
                b,
                k_start,
                k_len,
                pos_m,
                BLOCK_TABLE,
                stride_bt,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                qk_scale,
                cap_log2,
                window_left,
                window_right,
                chunk,
                tau,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                MASKED,
                HAS_LEFT,
                HAS_RIGHT,
                SOFTCAP,
                EMU_DIV,
                PAGED,
                PAGE_SIZE,
                DOT_FP32,
            )
    return acc, m_i, l_i


@triton.jit
def _key_range(
    first,
    last,
    k_len,
    window_left,
    window_right,
    chunk,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Visible keys of query positions [first, last]: [lo, hi), and inside it the
    block-aligned [full_lo, full_hi) where no element needs a mask."""
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = k_len
    if HAS_LEFT:
        lo = tl.maximum(first_key(first, window_left, chunk), 0)
        full_lo = tl.maximum(first_key(last, window_left, chunk), 0)
    if HAS_RIGHT:
        hi = tl.minimum(last + window_right + 1, k_len)
        full_hi = tl.minimum(tl.maximum(first + window_right + 1, 0), k_len)
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(lo, hi) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N * BLOCK_N, full_lo), hi)
    return lo, hi, full_lo, full_hi


# NOTE: ints that change from launch to launch are not specialised (== 1, % 16): each new
# class would be a new JIT compile, seconds of a request's first token after a restore.
@triton.jit(do_not_specialize=["stride_bt", "stride_lh", "batch", "num_m_blocks"])
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    CU_Q,
    K_META,
    BLOCK_TABLE,
    ORDER,
    SINKS,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_lh,
    qk_scale,
    cap_log2,
    window_left,
    window_right,
    chunk,
    tau,
    batch,
    num_m_blocks,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    SECTION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMU_DIV: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    LPT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    if LPT:  # (section, block from the end, sequence longest first, head in section)
        per_section = num_m_blocks * batch * SECTION
        section = pid // per_section
        rem = pid % per_section
        m_block = num_m_blocks - 1 - rem // (batch * SECTION)
        rem = rem % (batch * SECTION)
        b = tl.load(ORDER + rem // SECTION)
        head = section * SECTION + rem % SECTION
    else:  # (sequence, head, query block)
        m_block = pid % num_m_blocks
        head = (pid // num_m_blocks) % HQ
        b = pid // (num_m_blocks * HQ)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    if PAGED:
        k_start = 0
        k_len = tl.load(K_META + b)
    else:
        k_start = tl.load(K_META + b)
        k_len = tl.load(K_META + b + 1) - k_start
    if m_block * BLOCK_M < q_len:
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        shift = k_len - q_len  # bottom-right alignment
        pos_m = offs_m + shift
        first = m_block * BLOCK_M + shift
        last = tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len) - 1 + shift
        lo, hi, full_lo, full_hi = _key_range(
            first, last, k_len, window_left, window_right, chunk, HAS_LEFT, HAS_RIGHT, BLOCK_N
        )
        kvh = head // GROUP
        Kh = K + kvh * stride_kh
        Vh = V + kvh * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        acc, m_i, l_i = _attn_blocks(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            b,
            k_start,
            k_len,
            pos_m,
            lo,
            full_lo,
            BLOCK_TABLE,
            stride_bt,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            cap_log2,
            window_left,
            window_right,
            chunk,
            tau,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            True,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            EMU_DIV,
            PAGED,
            PAGE_SIZE,
            DOT_FP32,
            NUM_STAGES,
            False,
            INTERPRET,
        )
        acc, m_i, l_i = _attn_blocks(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            b,
            k_start,
            k_len,
            pos_m,
            full_lo,
            full_hi,
            BLOCK_TABLE,
            stride_bt,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            qk_scale,
            cap_log2,
            window_left,
            window_right,
            chunk,
            tau,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            False,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            EMU_DIV,
            PAGED,
            PAGE_SIZE,
            DOT_FP32,
            NUM_STAGES,
            WARP_SPEC,
            INTERPRET,
        )
        acc, m_i, l_i = _attn_blocks(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            b,
            k_start,
            k_len,
            pos_m,
            full_hi,
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
            window_right,
            chunk,
            tau,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            True,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            EMU_DIV,
            PAGED,
            PAGE_SIZE,
            DOT_FP32,
            NUM_STAGES,
            False,
            INTERPRET,
        )
        if HAS_SINKS:
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
            acc, m_i, l_i = add_sink(acc, m_i, l_i, sink)
        empty = l_i == 0.0  # fully masked row (and no sink): output 0, LSE -inf
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(
            Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )
        if RETURN_LSE:
            lse = tl.where(
                empty,
                float("-inf"),
                (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634,
            )
            tl.store(LSE + head * stride_lh + q_start + offs_m, lse, mask=m_ok)


# ----------------------------------------------------------------------------- host code
def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def emu_div(fraction: float) -> int:
    """Emulated fraction -> the kernel's EMU_DIV (nearest of 0, 1/8, 1/4, 1/2, 1)."""
    _check(0.0 <= fraction <= 1.0, f"emulate_fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return 0
    choices = {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.125}
    return min(choices, key=lambda d: abs(choices[d] - fraction))


def _candidates(head_dim: int, warp_spec: bool, emu: int | None) -> list[tuning.Config]:
    """GPU tuning candidates per head dim (tile M x N, warps, stages, WS, emulation)."""
    if head_dim <= 64:
        tiles = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)]
    elif head_dim <= 128:
        tiles = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
    else:
        tiles = [(64, 64, 4, 2), (128, 32, 8, 2)]
    out = []
    for i, (bm, bn, w, s) in enumerate(tiles):
        for ws in (False, True) if warp_spec and i == 0 else (False,):
            for e in (0, 8) if emu is None and i == 0 else (emu or 0,):
                out.append(
                    dict(
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        num_warps=w,
                        num_stages=s,
                        WARP_SPEC=int(ws),
                        EMU_DIV=e,
                    )
                )
    return out


def interpreter_config(emu: int | None) -> tuning.Config:
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, WARP_SPEC=0, EMU_DIV=emu or 0)


def _section(hq: int, group: int, kv_bytes_per_head: int) -> int:
    """Query heads per L2 section: whole GQA groups whose K+V fit in ``L2_BUDGET``."""
    hkv = hq // group
    fit = max(1, min(hkv, L2_BUDGET // max(kv_bytes_per_head, 1)))
    while hkv % fit:
        fit -= 1
    return fit * group


def flash_attn_varlen_func(
    q: torch.Tensor,  # (total_q, Hq, D)
    k: torch.Tensor,  # (total_k, Hkv, D), or (num_blocks, block_size, Hkv, D) with block_table
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32
    cu_seqlens_k: torch.Tensor | None,  # (B + 1,) int32; None with block_table
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    block_table: torch.Tensor | None = None,  # (B, max_blocks) int32/int64
    seqused_k: torch.Tensor | None = None,  # (B,) keys per sequence (with block_table)
    tau: float = 8.0,
    emulate_fraction: float | None = None,
    lpt: bool = True,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # (Hq,) float logits (natural units)
    chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen forward: out (total_q, Hq, D) [, lse (Hq, total_q) fp32, natural].

    ``emulate_fraction=None`` lets the tuner choose (0 in the interpreter); ``tau=0`` rescales
    whenever a row max grows (the classic algorithm). ``sinks``: a per-head logit in every
    row's softmax denominator (no value); the LSE includes it. ``chunk``: a query at ``pos``
    sees no key before ``pos - pos % chunk`` (Llama 4's chunked local attention)."""
    paged = block_table is not None
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
    check_sinks(sinks, q)
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    batch = cu_seqlens_q.shape[0] - 1
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    right = 0 if causal else right
    left, chunk = chunk_bounds(left, chunk)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check(
            out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1,
            "out must match q's shape and dtype with a unit last stride",
        )
    lse = torch.empty((hq, total_q) if return_lse else (1, 1), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        if return_lse:
            lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    k_lens = seqused_k if paged else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    order = torch.argsort(k_lens.to(torch.int32), descending=True, stable=True).to(torch.int32)
    group = hq // hkv
    elem = q.element_size()
    section = _section(hq, group, 2 * k.shape[0] * (k.shape[1] if paged else 1) * d * elem)
    args = dict(
        q=q,
        k=k,
        v=v,
        out=out,
        lse=lse,
        cu_q=cu_seqlens_q,
        k_meta=seqused_k if paged else cu_seqlens_k,
        block_table=block_table,
        order=order,
        sinks=sinks,
        scale=scale,
        softcap=softcap,
        left=left,
        right=right,
        chunk=chunk,
        tau=tau,
        batch=batch,
        max_seqlen_q=max_seqlen_q,
        section=section,
        lpt=lpt,
        return_lse=return_lse,
    )
    emu = None if emulate_fraction is None else emu_div(emulate_fraction)
    if tuning.interpreting() or q.device.type != "cuda":
        cfg = interpreter_config(emu)
    else:
        key = ":".join(
            str(x)
            for x in (
                "fwd",
                tuning.device_key(q.device),
                d,
                q.dtype,
                group,
                int(causal),
                int(left >= 0),
                int(right >= 0),
                int(softcap > 0),
                int(paged),
                emu,
                tuning.seqlen_bucket(max_seqlen_q),
                tuning.seqlen_bucket(max_seqlen_k),
            )
        )
        cands = _candidates(d, tuning.warp_specialize_supported(q.device), emu)
        cfg = tuning.TUNER.pick(key, cands, lambda c: _launch(c, **args))
    _launch(cfg, **args)
    return (out, lse) if return_lse else out


def _launch(
    cfg: tuning.Config,
    *,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    k_meta,
    block_table,
    order,
    sinks,
    scale,
    softcap,
    left,
    right,
    chunk,
    tau,
    batch,
    max_seqlen_q,
    section,
    lpt,
    return_lse,
) -> None:
    _, hq, d = q.shape
    hkv = k.shape[-2]
    paged = block_table is not None
    bm = cfg["BLOCK_M"]
    num_m_blocks = triton.cdiv(max_seqlen_q, bm)
    if softcap > 0:
        qk_scale, cap_log2 = 2.0 * scale / softcap * LOG2E, softcap * LOG2E
    else:
        qk_scale, cap_log2 = scale * LOG2E, 0.0
    kb, kt, kh = (k.stride(0), k.stride(1), k.stride(2)) if paged else (0, k.stride(0), k.stride(1))
    vb, vt, vh = (v.stride(0), v.stride(1), v.stride(2)) if paged else (0, v.stride(0), v.stride(1))
    table = block_table if paged else k_meta  # any int tensor: never read when not paged
    grid = (num_m_blocks * batch * hq,)
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        k_meta,
        table,
        order,
        order if sinks is None else sinks,  # NOTE: never read without sinks
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kb,
        kt,
        kh,
        vb,
        vt,
        vh,
        table.stride(0) if paged else 0,
        lse.stride(0),
        qk_scale,
        cap_log2,
        left,
        right,
        chunk,
        float(tau),
        batch,
        num_m_blocks,
        HQ=hq,
        GROUP=hq // hkv,
        SECTION=section,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=bm,
        BLOCK_N=cfg["BLOCK_N"],
        HAS_LEFT=left >= 0,
        HAS_RIGHT=right >= 0,
        SOFTCAP=softcap > 0,
        EMU_DIV=cfg["EMU_DIV"],
        PAGED=paged,
        PAGE_SIZE=k.shape[1] if paged else 1,
        LPT=lpt,
        RETURN_LSE=return_lse,
        HAS_SINKS=sinks is not None,
        DOT_FP32=tuning.interpreting() and q.dtype == torch.bfloat16,
        NUM_STAGES=cfg["num_stages"],
        WARP_SPEC=bool(cfg["WARP_SPEC"]),
        INTERPRET=tuning.interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def chunk_bounds(left: int, chunk: int | None) -> tuple[int, int]:
    """A left window (-1: none) and a chunk (None: none) as the kernels take them: a chunk
    alone makes the window ``NO_WINDOW`` (the mask's bound is then the chunk's)."""
    if chunk is None:
        return left, NO_CHUNK
    _check(isinstance(chunk, int) and chunk > 0, f"chunk must be a positive int, got {chunk!r}")
    return (NO_WINDOW if left < 0 else left), chunk


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is not None:
        _check(
            sinks.shape == (q.shape[1],) and sinks.is_floating_point() and sinks.stride(0) == 1,
            f"sinks must be ({q.shape[1]},) float contiguous, got {tuple(sinks.shape)}",
        )
        _check(sinks.device == q.device, "sinks on another device than q")


def _check_inputs(q, k, v, cu_q, cu_k, block_table, seqused_k) -> None:
    paged = block_table is not None
    _check(q.dim() == 3, f"q must be (total_q, Hq, D), got {tuple(q.shape)}")
    _check(
        k.dim() == (4 if paged else 3),
        f"k has shape {tuple(k.shape)}; expected "
        + ("(num_blocks, block_size, Hkv, D)" if paged else "(total_k, Hkv, D)"),
    )
    _check(k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    _check(
        q.dtype in (torch.float16, torch.bfloat16, torch.float32),
        f"q dtype {q.dtype} not supported (fp16, bf16, fp32)",
    )
    _check(k.dtype == q.dtype == v.dtype, "q, k, v must share a dtype")
    _check(q.device == k.device == v.device == cu_q.device, "tensors on different devices")
    d, hq, hkv = q.shape[2], q.shape[1], k.shape[-2]
    _check(k.shape[-1] == d and d <= 256, f"head dim {d}: k/v must match q, at most 256")
    _check(hkv > 0 and hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}")
    _check(
        q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
        "q, k, v need a unit stride on the head dim",
    )
    _check(cu_q.dim() == 1 and not cu_q.is_floating_point(), "cu_seqlens_q must be 1-D int")
    if paged:
        bs = k.shape[1]
        _check(bs > 0 and bs & (bs - 1) == 0, f"block size {bs} must be a power of two")
        _check(
            seqused_k is not None and seqused_k.shape == (cu_q.shape[0] - 1,),
            "seqused_k (B,) is required with block_table",
        )
        _check(
            block_table.dim() == 2
            and block_table.shape[0] == cu_q.shape[0] - 1
            and block_table.dtype in (torch.int32, torch.int64),
            "block_table must be (B, max_blocks) int32/int64",
        )
    else:
        _check(cu_k is not None and cu_k.shape == cu_q.shape, "cu_seqlens_k must match cu_q")


def flash_attn_func(
    q: torch.Tensor,  # (B, Sq, Hq, D)
    k: torch.Tensor,  # (B, Sk, Hkv, D)
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batched forward: out (B, Sq, Hq, D) [, lse (B, Hq, Sq)]."""
    _check(q.dim() == 4 and k.dim() == 4, "flash_attn_func takes (batch, seqlen, heads, dim)")
    bsz, sq, hq, d = q.shape
    sk = k.shape[1]
    dev = q.device
    cu_q = torch.arange(0, (bsz + 1) * sq, sq, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (bsz + 1) * sk, sk, dtype=torch.int32, device=dev)
    res = flash_attn_varlen_func(
        q.reshape(bsz * sq, hq, d),
        k.reshape(bsz * sk, -1, d),
        v.reshape(bsz * sk, -1, d),
        cu_q,
        cu_k,
        sq,
        sk,
        softmax_scale,
        causal,
        window_size,
        softcap,
        return_lse,
        **kwargs,
    )
    if not return_lse:
        return res.view(bsz, sq, hq, d)
    o, lse = res
    return o.view(bsz, sq, hq, d), lse.view(hq, bsz, sq).transpose(0, 1)


def attention_flops(q_lens: list[int], k_lens: list[int], hq: int, d: int, causal: bool) -> float:
    """Forward FLOPs (4 * visible pairs * D * Hq), causal counted bottom-right aligned."""
    total = 0
    for sq, sk in zip(q_lens, k_lens, strict=True):
        pairs = sq * sk
        if causal:
            pairs = (
                sum(max(0, min(sk, sk - sq + i + 1)) for i in range(sq))
                if sq != sk
                else (sq * (sq + 1) // 2)
            )
        total += pairs
    return 4.0 * total * hq * d
