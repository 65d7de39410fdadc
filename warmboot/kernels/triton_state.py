"""The state layers' decode steps in Triton: one token per sequence, each sequence's state
read and written in place in its slot's row of the layer's cache (no gather into a batch, no
scatter back), the maths of ``kernels.recurrent``'s ``_step`` functions (float32 states and
arithmetic; outputs in the input's dtype).

- ``gated_delta_decode`` / ``kda_decode``: grid ``(row, head, value block)``; a program holds
  the ``(Dk, BLOCK_V)`` columns of its head's state ``S (Dk, Dv)`` (the delta rule's columns
  are independent: each program reads the whole of q and k and normalises them itself).
- ``ssd_decode``: grid ``(row, head, head-dim block)``; a program holds ``(BLOCK_P, N)`` rows
  of its head's state ``h (P, N)``.
- ``conv_decode``: grid ``(row, channel block)``; a program shifts its channels' windows
  (``K - 1`` inputs each) one place left and appends the new input.

Every program writes only the state it read, and no other program touches it, so the slots
must be distinct (a step's decode rows are distinct sequences). The cache's rows must be
contiguous (its slot stride is free); the per-token inputs are made contiguous (a copy of a
few numbers per row at most). No host synchronisation and no data-dependent Python: a launch
depends only on shapes, so a decode step can be captured in a CUDA graph. On the CPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): slow, for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmboot.kernels.recurrent import L2NORM_EPS

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_V = 32
"""State columns per delta-rule program: a (Dk <= 256) x 32 float32 tile."""
BLOCK_P = 32
"""State rows per SSD program: a 32 x (N <= 256) float32 tile."""
BLOCK_C = 256
"""Channels per conv program."""
MAX_DIM = 256
"""The widest key head dim (delta rules) and state size (SSD): one program holds them all."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_cache(name: str, cache, slots, dims: int, dtypes=(torch.float32,)) -> int:
    """The number of rows (``slots``' length) of a (num_slots, ...) cache of ``dims`` dims."""
    _check(cache.dim() == dims, f"{name}: the state cache must have {dims} dims: {cache.dim()}")
    _check(cache.dtype in dtypes, f"{name}: the state cache must be {dtypes}: {cache.dtype}")
    _check(
        cache.shape[0] == 0 or cache[0].is_contiguous(),
        f"{name}: the state cache's rows must be contiguous",
    )
    _check(
        slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64),
        f"{name}: slots must be 1-d int32/int64: {tuple(slots.shape)} {slots.dtype}",
    )
    _check(slots.device == cache.device, f"{name}: slots must be on the state cache's device")
    return slots.shape[0]


def _inputs(name: str, cache, **tensors) -> list[torch.Tensor]:
    """Each ``name=(tensor, shape)`` checked (shape, dtype, device) and made contiguous."""
    out = []
    for arg, (t, shape) in tensors.items():
        _check(
            t.dim() == len(shape) and tuple(t.shape) == shape,
            f"{name}: {arg} must be {shape}, got {tuple(t.shape)}",
        )
        _check(t.dtype in _DTYPES, f"{name}: {arg} must be float32/bfloat16/float16: {t.dtype}")
        _check(t.device == cache.device, f"{name}: {arg} must be on the state cache's device")
        out.append(t.contiguous())
    return out


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _block(dim: int, override: int | None, default: int) -> int:
    """Columns/rows/channels per program: ``override`` (a power of two) or ``default``, no
    wider than ``dim`` padded."""
    block = default if override is None else override
    _check(block > 0 and block & (block - 1) == 0, f"block {block} must be a power of two")
    return min(_pow2(dim), block)


# --------------------------------------------------------------------------- delta rules


@triton.jit
def _delta_kernel(
    Cache,
    Slots,
    Q,
    K,
    V,
    G,
    Beta,
    Out,
    slot_stride,
    scale,
    eps,
    H: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """The gated delta rule's step (PER_CHANNEL: KDA's decay per key channel, its l2norm a
    division) on columns [vb * BLOCK_V, ...) of S = Cache[Slots[row], h] (DK, DV)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    qk = (row * HK + h // (H // HK)) * DK + offs_k  # the q/k head serving value head h
    q = tl.load(Q + qk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(K + qk, mask=k_ok, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        q = q / tl.sqrt(tl.sum(q * q, 0) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(G + (row * H + h) * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        decay = tl.exp(g)[:, None]  # (BLOCK_K, 1)
    else:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        decay = tl.exp(tl.load(G + row * H + h).to(tl.float32))
    beta = tl.load(Beta + row * H + h).to(tl.float32)
    v = tl.load(V + (row * H + h) * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    slot = tl.load(Slots + row).to(tl.int64)
    ptrs = Cache + slot * slot_stride + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    kv_ok = k_ok[:, None] & v_ok[None, :]
    S = tl.load(ptrs, mask=kv_ok, other=0.0) * decay  # (BLOCK_K, BLOCK_V)
    delta = (v - tl.sum(k[:, None] * S, 0)) * beta  # v minus what S recalls for k
    S += k[:, None] * delta[None, :]
    tl.store(ptrs, S, mask=kv_ok)
    o = tl.sum(q[:, None] * S, 0)
    tl.store(Out + (row * H + h) * DV + offs_v, o.to(Out.dtype.element_ty), mask=v_ok)


def _delta(cache, slots, q, k, v, g, beta, scale, per_channel: bool, block_v) -> torch.Tensor:
    name = "kda_decode" if per_channel else "gated_delta_decode"
    rows = _check_cache(name, cache, slots, 4)
    _, H, DK, DV = cache.shape
    hk = q.shape[1] if q.dim() == 3 else 0
    _check(
        hk > 0 and H % hk == 0 and (hk == H or not per_channel),
        f"{name}: q's {hk} heads must {'be' if per_channel else 'divide'} the state's {H}",
    )
    _check(DK <= MAX_DIM, f"{name}: key head dim {DK} > {MAX_DIM}")
    q, k, v, g, beta = _inputs(
        name,
        cache,
        q=(q, (rows, hk, DK)),
        k=(k, (rows, hk, DK)),
        v=(v, (rows, H, DV)),
        g=(g, (rows, H, DK) if per_channel else (rows, H)),
        beta=(beta, (rows, H)),
    )
    out = torch.empty(rows, H, DV, dtype=v.dtype, device=v.device)
    if rows:
        bv = _block(DV, block_v, BLOCK_V)
        _delta_kernel[(rows, H, triton.cdiv(DV, bv))](
            cache,
            slots,
            q,
            k,
            v,
            g,
            beta,
            out,
            cache.stride(0),
            float(scale),
            L2NORM_EPS,
            H=H,
            HK=hk,
            DK=DK,
            DV=DV,
            BLOCK_K=_pow2(DK),
            BLOCK_V=bv,
            PER_CHANNEL=per_channel,
            num_warps=4,
        )
    return out


def gated_delta_decode(cache, slots, q, k, v, g, beta, scale: float, *, block_v=None):
    """``recurrent.recurrent_gated_delta_step`` on ``cache[slots]`` in place.

    cache (num_slots, H, Dk, Dv) float32; slots (B,) distinct, int32/int64; q, k (B, Hk, Dk)
    not yet normalised (Hk divides H: head h reads q/k head h // (H // Hk)); v (B, H, Dv);
    g (B, H) log decay; beta (B, H). Returns o (B, H, Dv) in v's dtype. ``block_v``: state
    columns per program (a power of two; default ``BLOCK_V``)."""
    return _delta(cache, slots, q, k, v, g, beta, scale, False, block_v)


def kda_decode(cache, slots, q, k, v, g, beta, scale: float, *, block_v=None):
    """``recurrent.recurrent_kda_step`` on ``cache[slots]`` in place: ``gated_delta_decode``
    with q, k (B, H, Dk) and g (B, H, Dk) a log decay per key channel."""
    return _delta(cache, slots, q, k, v, g, beta, scale, True, block_v)


# --------------------------------------------------------------------------- Mamba 2 SSD


@triton.jit
def _ssd_kernel(
    Cache,
    Slots,
    X,
    Dt,
    A,
    Bm,
    Cm,
    D,
    Y,
    slot_stride,
    H: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h <- exp(dt A) h + (dt x) B^T and y = h C + D x on rows [pb * BLOCK_P, ...) of
    h = Cache[Slots[row], head] (P, N); B, C of the head's group."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_ok = offs_p < P
    n_ok = offs_n < N
    bc = (row * G + h // (H // G)) * N + offs_n
    b = tl.load(Bm + bc, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(Cm + bc, mask=n_ok, other=0.0).to(tl.float32)
    dt = tl.load(Dt + row * H + h).to(tl.float32)
    decay = tl.exp(dt * tl.load(A + h).to(tl.float32))
    x = tl.load(X + (row * H + h) * P + offs_p, mask=p_ok, other=0.0).to(tl.float32)
    slot = tl.load(Slots + row).to(tl.int64)
    ptrs = Cache + slot * slot_stride + h * P * N + offs_p[:, None] * N + offs_n[None, :]
    pn_ok = p_ok[:, None] & n_ok[None, :]
    state = tl.load(ptrs, mask=pn_ok, other=0.0) * decay + x[:, None] * (dt * b)[None, :]
    tl.store(ptrs, state, mask=pn_ok)
    y = tl.sum(state * c[None, :], 1) + x * tl.load(D + h).to(tl.float32)
    tl.store(Y + (row * H + h) * P + offs_p, y.to(Y.dtype.element_ty), mask=p_ok)


def ssd_decode(cache, slots, x, dt, A, B, C, D, *, block_p=None) -> torch.Tensor:
    """``recurrent.ssd_step`` on ``cache[slots]`` in place.

    cache (num_slots, H, P, N) float32; slots (B,) distinct, int32/int64; x (B, H, P);
    dt (B, H) already softplus-ed; A, D (H,); B, C (B, G, N), G dividing H (head h uses group
    h // (H // G)). Returns y (B, H, P) in x's dtype. ``block_p``: state rows per program (a
    power of two; default ``BLOCK_P``)."""
    rows = _check_cache("ssd_decode", cache, slots, 4)
    _, H, P, N = cache.shape
    groups = B.shape[1] if B.dim() == 3 else 0
    _check(groups > 0 and H % groups == 0, f"ssd_decode: B's {groups} groups must divide {H}")
    _check(N <= MAX_DIM, f"ssd_decode: state size {N} > {MAX_DIM}")
    x, dt, A, B, C, D = _inputs(
        "ssd_decode",
        cache,
        x=(x, (rows, H, P)),
        dt=(dt, (rows, H)),
        A=(A, (H,)),
        B=(B, (rows, groups, N)),
        C=(C, (rows, groups, N)),
        D=(D, (H,)),
    )
    y = torch.empty(rows, H, P, dtype=x.dtype, device=x.device)
    if rows:
        bp = _block(P, block_p, BLOCK_P)
        _ssd_kernel[(rows, H, triton.cdiv(P, bp))](
            cache,
            slots,
            x,
            dt,
            A,
            B,
            C,
            D,
            y,
            cache.stride(0),
            H=H,
            G=groups,
            P=P,
            N=N,
            BLOCK_P=bp,
            BLOCK_N=_pow2(N),
            num_warps=4,
        )
    return y


# --------------------------------------------------------------------------- short conv


@triton.jit
def _conv_kernel(
    Cache,
    Slots,
    X,
    W,
    Bias,
    Y,
    slot_stride,
    C: tl.constexpr,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """y = act(bias + sum_j w_j window_j) over the window (the KW - 1 inputs kept in
    Cache[Slots[row]] (C, KW - 1), oldest first, then x), which moves one input on. A thread
    reads and writes the same channels, so the shift in place needs no barrier."""
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    slot = tl.load(Slots + row).to(tl.int64)
    window = Cache + slot * slot_stride + offs_c * (KW - 1)  # column j at window + j
    x = tl.load(X + row * C + offs_c, mask=c_ok, other=0.0)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    for j in tl.static_range(KW - 1):
        s = tl.load(window + j, mask=c_ok, other=0.0)
        acc += tl.load(W + offs_c * KW + j, mask=c_ok, other=0.0).to(tl.float32) * s.to(tl.float32)
        if j > 0:
            tl.store(window + j - 1, s, mask=c_ok)
    if KW > 1:
        tl.store(window + KW - 2, x, mask=c_ok)
    w_last = tl.load(W + offs_c * KW + KW - 1, mask=c_ok, other=0.0).to(tl.float32)
    acc += w_last * x.to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Y + row * C + offs_c, acc.to(Y.dtype.element_ty), mask=c_ok)


def conv_decode(cache, slots, x, weight, bias, activation, *, block_c=None) -> torch.Tensor:
    """``recurrent.causal_conv1d_step`` on ``cache[slots]`` in place.

    cache (num_slots, C, K - 1) in x's dtype, the last K - 1 inputs oldest first; slots (B,)
    distinct, int32/int64; x (B, C); weight (C, K); bias (C,) or None; activation None,
    "silu" or "swish". Returns y (B, C) in x's dtype, accumulated in float32. ``block_c``:
    channels per program (a power of two; default ``BLOCK_C``)."""
    name = "conv_decode"
    _check(activation in (None, "silu", "swish"), f"{name}: activation {activation!r}")
    rows = _check_cache(name, cache, slots, 3, _DTYPES)
    _, C, K1 = cache.shape
    _check(x.dtype == cache.dtype, f"{name}: x ({x.dtype}) and the cache ({cache.dtype}) differ")
    tensors = dict(x=(x, (rows, C)), weight=(weight, (C, K1 + 1)))
    if bias is not None:
        tensors["bias"] = (bias, (C,))
    x, weight, *rest = _inputs(name, cache, **tensors)
    y = torch.empty(rows, C, dtype=x.dtype, device=x.device)
    if rows:
        bc = _block(C, block_c, BLOCK_C)
        _conv_kernel[(rows, triton.cdiv(C, bc))](
            cache,
            slots,
            x,
            weight,
            rest[0] if rest else weight,
            y,
            cache.stride(0),
            C=C,
            KW=K1 + 1,
            HAS_BIAS=bool(rest),
            SILU=activation is not None,
            BLOCK_C=bc,
            num_warps=4,
        )
    return y
