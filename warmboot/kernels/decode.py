"""Paged decode attention (flash-decoding) in Triton.

One query token per sequence against a paged KV cache ``(num_blocks, block_size, Hkv, D)``:

- grid ``(split, kv head, sequence)``: each program takes all ``Hq / Hkv`` query heads of its
  KV head (GQA packing: K/V read once per group) and a contiguous share of the visible keys;
- split-K: with ``num_splits > 1`` programs write fp32 partial outputs and log-sum-exps and
  a combine kernel merges them; with one split the kernel writes the output directly;
- keys are addressed through the block table per key, so any power-of-two block size works;
- sliding window (``window_size[0]`` keys to the left of the query) and tanh softcap.

No host synchronisation and no data-dependent Python: the launch depends only on shapes, so
it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmboot.kernels import tuning
from warmboot.kernels.attention import LOG2E, _attn_blocks


@triton.jit
def _decode_kernel(
    Q, K, V, Out, OPart, LPart, BLOCK_TABLE, SEQ_LENS,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_pb, stride_ph,
    qk_scale, cap_log2, window_left, tau, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr,
    SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(seq_len - 1 - window_left, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    Kh = K + kvh * stride_kh
    Vh = V + kvh * stride_vh
    acc, m_i, l_i = _attn_blocks(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        b,
        0,
        end,
        offs_g,
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
        0,
        0,
        tau,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        True,
        False,
        False,
        SOFTCAP,
        0,
        True,
        PAGE_SIZE,
        DOT_FP32,
        NUM_STAGES,
        False,
        INTERPRET,
    )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    hd_ok = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        base = b.to(tl.int64) * stride_pb + heads * stride_ph  # (BLOCK_G,)
        tl.store(OPart + ((base + split) * BLOCK_D)[:, None] + offs_d[None, :], out,
                 mask=hd_ok)  # fmt: skip
        tl.store(LPart + base + split, lse2, mask=g_ok)
    else:
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=hd_ok)
        tl.store(LPart + b.to(tl.int64) * stride_pb + heads * stride_ph, lse2, mask=g_ok)


@triton.jit
def _combine_kernel(
    Out, OPart, LPart, stride_ob, stride_oh, stride_pb, stride_ph, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(lse_s - lse) * o_s over the splits of one (sequence, head)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = b.to(tl.int64) * stride_pb + h * stride_ph
    lse = tl.load(LPart + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # (BLOCK_S,); 0 for empty splits
    o = tl.load(
        OPart + ((base + offs_s) * BLOCK_D)[:, None] + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    o_ptr = Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    lse_all = tl.where(total == 0.0, float("-inf"), m_safe + tl.log2(tl.maximum(total, 1e-30)))
    tl.store(LPart + base, lse_all)  # slot 0 of the row now holds the total


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_inputs(q, k_cache, v_cache, block_table, seqused_k) -> None:
    _check(q.dim() == 3, f"q must be (batch, Hq, D), got {tuple(q.shape)}")
    _check(k_cache.dim() == 4, "k_cache must be (num_blocks, block_size, Hkv, D)")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    _check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {q.dtype}")
    _check(k_cache.dtype == v_cache.dtype == q.dtype, "q and the caches must share a dtype")
    batch, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    _check(dk == d and d <= 256, f"head dim {d} (cache {dk}): must match, at most 256")
    _check(hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}")
    _check(bs > 0 and bs & (bs - 1) == 0, f"block size {bs} must be a power of two")
    _check(
        q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
        "q and the caches need a unit stride on the head dim",
    )
    _check(
        block_table.dim() == 2
        and block_table.shape[0] == batch
        and block_table.dtype in (torch.int32, torch.int64),
        "block_table must be (batch, max_blocks) int32/int64",
    )
    _check(seqused_k.shape == (batch,) and not seqused_k.is_floating_point(), "seqused_k (B,)")


def default_num_splits(batch: int, hkv: int, max_len: int, device: torch.device) -> int:
    """Enough programs for about two waves on a GPU; few in the interpreter."""
    blocks = max(1, triton.cdiv(max_len, 64))
    if device.type != "cuda" or tuning.interpreting():
        return min(blocks, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, 64, triton.cdiv(2 * sms, batch * hkv)))


def paged_decode_attention(
    q: torch.Tensor,  # (batch, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (batch, max_blocks) int32/int64
    seqused_k: torch.Tensor,  # (batch,) keys per sequence, the new token's included
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int | None = None,
    return_lse: bool = False,
    *,
    tau: float = 8.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out (batch, Hq, D) [, lse (Hq, batch) fp32 natural]; the query sits at the last key."""
    _check_inputs(q, k_cache, v_cache, block_table, seqused_k)
    batch, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    if num_splits is None:
        num_splits = default_num_splits(batch, hkv, block_table.shape[1] * bs, q.device)
    _check(num_splits >= 1, "num_splits must be >= 1")
    if out is None:
        out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(d))
    split = num_splits > 1
    o_part = torch.empty((batch, hq, num_splits, block_d) if split else (1,), device=q.device)
    l_part = torch.empty((batch, hq, num_splits), device=q.device)
    if batch:
        _launch(q, k_cache, v_cache, out, o_part, l_part, block_table, seqused_k, scale,
                window_size[0], softcap, tau, num_splits, block_d)  # fmt: skip
    if not return_lse:
        return out
    return out, (l_part[:, :, 0] / LOG2E).transpose(0, 1)


def _launch(q, k_cache, v_cache, out, o_part, l_part, table, seqlens, scale, left, softcap,
            tau, num_splits, block_d) -> None:  # fmt: skip
    batch, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    interp = tuning.interpreting()
    if softcap > 0:
        qk_scale, cap_log2 = 2.0 * scale / softcap * LOG2E, softcap * LOG2E
    else:
        qk_scale, cap_log2 = scale * LOG2E, 0.0
    block_n = 16 if interp else (32 if d > 128 else 64)
    _decode_kernel[(num_splits, hkv, batch)](
        q, k_cache, v_cache, out, o_part, l_part, table, seqlens,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0),
        out.stride(0), out.stride(1), l_part.stride(0), l_part.stride(1),
        qk_scale, cap_log2, left, float(tau), num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=bs, HAS_LEFT=left >= 0,
        SOFTCAP=softcap > 0, SPLIT=num_splits > 1,
        DOT_FP32=interp and q.dtype == torch.bfloat16, NUM_STAGES=1 if interp else 3,
        INTERPRET=interp, num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(hq, batch)](
            out, o_part, l_part, out.stride(0), out.stride(1), l_part.stride(0),
            l_part.stride(1), num_splits, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )  # fmt: skip
