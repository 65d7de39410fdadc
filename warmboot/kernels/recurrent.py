"""Torch implementations of the per-request-state primitives of hybrid models: the depthwise
causal short convolution (Mamba 2's and gated DeltaNet's conv1d, LFM2's short conv), the
gated delta rule (Qwen3-Next / Qwen3.5 linear attention), its per-channel-decay variant
(Kimi Delta Attention, KDA) and Mamba 2's selective state space in its chunked (SSD) form
(Granite 4, Bamba, Nemotron-H, Falcon-H1).

Each comes twice: a prefill form over one sequence (``(L, ...)`` tensors) that starts from a
saved state and returns the new one, written as chunked matrix products (no Python loop over
tokens; the delta rule loops over chunks), and a decode form (``_step``) that advances a batch
of sequences by one token each and updates their ``states`` in place. The maths follow
transformers 5.23's torch reference code (``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` in ``modeling_qwen3_next``, ``chunk_kimi_delta_attention``
/ ``recurrent_kimi_delta_attention`` in ``modeling_kimi_linear``, ``mamba2_chunk_scan`` /
``mamba2_selective_state_update`` in ``modeling_mamba2``, ``causal_conv1d_fn`` /
``causal_conv1d_update``), including which ops run in float32, so fp32 results agree with it
to float rounding (``tests/test_recurrent_kernels.py``).

States: the conv state holds the last ``K-1`` inputs in the activations' dtype (transformers
keeps ``K``, the oldest of which never reaches an output); the delta-rule states
``(H, Dk, Dv)`` and the SSM state ``(H, P, N)`` are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6
"""The eps of the q/k L2 normalisation inside the gated delta rule (FLA's and transformers')."""


def _activate(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


# --------------------------------------------------------------------------- short conv


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor, activation: str | None
) -> tuple[Tensor, Tensor]:
    """One sequence through a depthwise causal conv1d that continues from `state`.

    x: (L, C); weight: (C, K); bias: (C,) or None; state: (C, K-1) the previous K-1 inputs
    (oldest first; zeros for a fresh sequence), same dtype as x. activation: None or "silu".
    Returns y (L, C) in x's dtype and the new state (C, K-1): the last K-1 inputs of
    concat(state, x) (works for L < K-1 too). Computed in the weight's dtype, as transformers'
    ``causal_conv1d_fn`` does."""
    C, K = weight.shape
    L = x.shape[0]
    if L == 0:
        return x.new_empty(0, C), state.to(x.dtype, copy=True)
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # (C, K-1+L): the window of every output
    y = F.conv1d(full.to(weight.dtype)[None], weight[:, None, :], bias, groups=C)  # (1, C, L)
    y = _activate(y[0], activation).t().to(x.dtype)  # (L, C)
    new_state = full[:, L:].contiguous()  # (C, K-1), a fresh tensor (never a view of x)
    return y, new_state


def causal_conv1d_step(
    x: Tensor, weight: Tensor, bias: Tensor | None, states: Tensor, activation: str | None
) -> Tensor:
    """One new token for each of B sequences. x: (B, C); weight: (C, K); bias: (C,) or None;
    states: (B, C, K-1), updated in place (shifted left by one, x appended). Returns y (B, C)
    in x's dtype."""
    C = weight.shape[0]
    full = torch.cat([states, x[:, :, None].to(states.dtype)], dim=2)  # (B, C, K)
    y = F.conv1d(full.to(weight.dtype), weight[:, None, :], bias, groups=C)  # (B, C, 1)
    states.copy_(full[:, :, 1:])  # drop the oldest input
    return _activate(y[:, :, 0], activation).to(x.dtype)  # (B, C)


# --------------------------------------------------------------------------- gated delta rule


def _l2norm(x: Tensor) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as FLA (and transformers' ``l2norm``) do."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _repeat_heads(x: Tensor, heads: int) -> Tensor:
    """Grouped heads: each of x's heads (dim -2) serves heads // x.shape[-2] consecutive heads
    (transformers' ``repeat_interleave`` when linear_num_key_heads < linear_num_value_heads)."""
    n = x.shape[-2]
    return x if n == heads else x.repeat_interleave(heads // n, dim=-2)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over one sequence in chunked (WY / UT-transform) form from `state`.

    q, k: (L, Hk, Dk), not yet L2-normalised (done here in float32, eps 1e-6); Hk may divide
    H, each q/k head then serving H // Hk consecutive value heads. v: (L, H, Dv); g: (L, H)
    log-decay (<= 0); beta: (L, H) in (0, 1); state: (H, Dk, Dv) float32. With q, k
    normalised, the recurrence (float32) is

        S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,
        o_t = scale * S_t^T q_t.

    Returns o (L, H, Dv) in v's dtype and the final state (H, Dk, Dv) float32."""
    L, H, Dv = v.shape
    Dk, out_dtype = q.shape[-1], v.dtype
    T = chunk_size
    pad = (-L) % T
    n = (L + pad) // T

    # (H, L, D) float32, q/k normalised, q scaled; then zero-padded to n chunks (a padded
    # token has beta = 0 and g = 0: it neither writes nor decays the state).
    def heads_first(t: Tensor) -> Tensor:
        return _repeat_heads(t, H).transpose(0, 1).to(torch.float32)

    q = _l2norm(heads_first(q)) * scale
    k = _l2norm(heads_first(k))
    v = heads_first(v)
    q, k = (F.pad(t, (0, 0, 0, pad)).reshape(H, n, T, Dk) for t in (q, k))  # (H, n, T, Dk)
    v = F.pad(v, (0, 0, 0, pad)).reshape(H, n, T, Dv)  # (H, n, T, Dv)
    beta, g = (F.pad(t.t().to(torch.float32), (0, pad)).reshape(H, n, T) for t in (beta, g))

    k_beta = k * beta[..., None]  # (H, n, T, Dk)
    v_beta = v * beta[..., None]  # (H, n, T, Dv)
    g_cum = g.cumsum(dim=-1)  # (H, n, T): log decay from the chunk's start to each token
    upper = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    # decay[..., i, j] = exp(g_cum_i - g_cum_j) for j <= i (the decay between tokens j and i), else 0
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, float("-inf")).exp()

    # Within a chunk the delta rule's updates form a unit lower-triangular system
    # (I + tril(diag(beta) K K^T * decay, -1)) U = V_beta (the diagonal is ignored): solving it
    # gives the values each token writes (u) and the decayed keys that read the chunk's start
    # state (w), so that the token's correction is v_new = u - w S_start.
    system = (k_beta @ k.transpose(-1, -2)) * decay  # (H, n, T, T)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True
    )  # (H, n, T, Dk)
    attn = (q @ k.transpose(-1, -2)) * decay  # (H, n, T, T) causal scores, diagonal included

    q_decayed = q * g_cum.exp()[..., None]  # reads the chunk's start state, decayed to token i
    k_decayed = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # writes, decayed to chunk end
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # (H, n, 1, 1)

    S = state.to(torch.float32, copy=True)  # (H, Dk, Dv)
    o = torch.empty(H, n, T, Dv, dtype=torch.float32, device=v.device)
    for c in range(n):  # sequential over chunks only
        v_new = u[:, c] - w[:, c] @ S  # (H, T, Dv)
        o[:, c] = q_decayed[:, c] @ S + attn[:, c] @ v_new
        S = S * chunk_decay[:, c] + k_decayed[:, c].transpose(-1, -2) @ v_new
    o = o.reshape(H, n * T, Dv)[:, :L].transpose(0, 1).to(out_dtype)  # (L, H, Dv)
    return o, S


def recurrent_gated_delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor, scale: float
) -> Tensor:
    """One token for each of B sequences: q, k (B, Hk, Dk) not yet normalised (Hk divides H);
    v (B, H, Dv); g, beta (B, H); states (B, H, Dk, Dv) float32, updated in place.
    Returns o (B, H, Dv) in v's dtype."""
    H = v.shape[1]
    q = _l2norm(_repeat_heads(q, H).to(torch.float32)) * scale  # (B, H, Dk)
    k = _l2norm(_repeat_heads(k, H).to(torch.float32))  # (B, H, Dk)
    states.mul_(g.to(torch.float32).exp()[..., None, None])  # decay
    recalled = torch.einsum("bhk,bhkv->bhv", k, states)  # (B, H, Dv): what the state predicts
    delta = (v.to(torch.float32) - recalled) * beta.to(torch.float32)[..., None]  # (B, H, Dv)
    states.addcmul_(k[..., :, None], delta[..., None, :])  # S += k delta^T
    return torch.einsum("bhk,bhkv->bhv", q, states).to(v.dtype)  # (B, H, Dv)


# --------------------------------------------------------------------------- Kimi delta attention


def _l2norm_div(x: Tensor) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: KDA's normalisation (FLA's ``l2norm``, written
    as a division there and in transformers' ``modeling_kimi_linear``)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Kimi delta attention over one sequence in chunked form from `state`: the gated delta
    rule with a decay per key channel instead of per head.

    q, k: (L, H, Dk), not yet L2-normalised (done here in float32, eps 1e-6); v: (L, H, Dv);
    g: (L, H, Dk) log-decay (<= 0) per key channel; beta: (L, H); state: (H, Dk, Dv) float32.
    With q, k normalised and ``D_t = diag(exp(g_t))``, the recurrence (float32) is

        S_t = D_t S_{t-1} + k_t (beta_t (v_t - (D_t S_{t-1})^T k_t))^T,
        o_t = scale * S_t^T q_t.

    Returns o (L, H, Dv) in v's dtype and the final state (H, Dk, Dv) float32. Chunks of
    ``min(chunk_size, L)`` tokens; the decays between a chunk's tokens are formed per channel
    as ``exp(G_i - G_j)`` of the cumulative log decays (never as a quotient, which overflows),
    one chunk at a time: (H, T, T, Dk) floats."""
    L, H, Dv = v.shape
    out_dtype = v.dtype
    if L == 0:
        return v.new_empty(0, H, Dv), state.to(torch.float32, copy=True)
    T = min(chunk_size, L)
    pad = (-L) % T
    n = (L + pad) // T

    # (H, n, T, D) float32, heads first, zero-padded (a padded token neither writes nor decays)
    def chunked(t: Tensor) -> Tensor:
        t = F.pad(t.transpose(0, 1).to(torch.float32), (0, 0, 0, pad))
        return t.reshape(H, n, T, t.shape[-1])

    q = chunked(_l2norm_div(q.to(torch.float32)) * scale)
    k = chunked(_l2norm_div(k.to(torch.float32)))
    v, G = chunked(v), chunked(g).cumsum(dim=-2)  # G: log decay from the chunk's start
    beta = F.pad(beta.t().to(torch.float32), (0, pad)).reshape(H, n, T, 1)
    k_beta, v_beta = k * beta, v * beta
    upper = torch.ones(T, T, dtype=torch.bool, device=v.device).triu(1)[..., None]

    S = state.to(torch.float32, copy=True)  # (H, Dk, Dv)
    o = torch.empty(H, n, T, Dv, dtype=torch.float32, device=v.device)
    for c in range(n):  # sequential over chunks only
        Gc, kc = G[:, c], k[:, c]  # (H, T, Dk)
        # keys decayed from token j to token i, per channel: [h, i, j, :] (0 for j > i)
        decay = (Gc[:, :, None] - Gc[:, None]).masked_fill(upper, float("-inf")).exp()
        k_to_i = kc[:, None] * decay  # (H, T, T, Dk)
        # The chunk's delta updates: a unit lower-triangular system in the values each token
        # writes, (I + strict_tril(beta_i k_i . k_j decayed)) U = V_beta - (K_beta exp(G)) S.
        system = (k_beta[:, c, :, None] * k_to_i).sum(-1)  # (H, T, T)
        u = torch.linalg.solve_triangular(system, v_beta[:, c], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(
            system, k_beta[:, c] * Gc.exp(), upper=False, unitriangular=True
        )
        v_new = u - w @ S  # (H, T, Dv)
        attn = (q[:, c, :, None] * k_to_i).sum(-1)  # (H, T, T) causal scores, diagonal included
        o[:, c] = (q[:, c] * Gc.exp()) @ S + attn @ v_new
        last = Gc[:, -1:]  # (H, 1, Dk)
        S = S * last.transpose(1, 2).exp() + (kc * (last - Gc).exp()).transpose(1, 2) @ v_new
    o = o.reshape(H, n * T, Dv)[:, :L].transpose(0, 1).to(out_dtype)  # (L, H, Dv)
    return o, S


def recurrent_kda_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor, scale: float
) -> Tensor:
    """One token for each of B sequences: q, k (B, H, Dk) not yet normalised; v (B, H, Dv);
    g (B, H, Dk) log decay per key channel; beta (B, H); states (B, H, Dk, Dv) float32,
    updated in place. Returns o (B, H, Dv) in v's dtype."""
    q = _l2norm_div(q.to(torch.float32)) * scale  # (B, H, Dk)
    k = _l2norm_div(k.to(torch.float32))  # (B, H, Dk)
    states.mul_(g.to(torch.float32).exp()[..., None])  # decay each key channel's row
    recalled = torch.einsum("bhk,bhkv->bhv", k, states)  # (B, H, Dv)
    delta = (v.to(torch.float32) - recalled) * beta.to(torch.float32)[..., None]
    states.addcmul_(k[..., :, None], delta[..., None, :])  # S += k delta^T
    return torch.einsum("bhk,bhkv->bhv", q, states).to(v.dtype)


# --------------------------------------------------------------------------- Mamba 2 SSD


def _segsum(x: Tensor) -> Tensor:
    """(..., T) -> (..., T, T): out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above
    the diagonal. Summed with masked cumsums rather than differences of one cumsum, which lose
    precision when the cumulative log decay is large (transformers' ``segment_sum``)."""
    T = x.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=x.device)
    x = x[..., None].expand(*x.shape, T)  # [..., k, j] = x_k
    x = x.masked_fill(~ones.tril(-1), 0).cumsum(dim=-2)  # sum of x_k for j < k <= i
    return x.masked_fill(~ones.tril(0), float("-inf"))


def ssd_chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    state: Tensor,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Mamba 2's selective state space over one sequence in chunked (SSD) form from `state`.

    x: (L, H, P); dt: (L, H) already softplus(dt + dt_bias) and clamped by the caller;
    A: (H,) negative (= -exp(A_log)); B, C: (L, G, N) with G dividing H (head h uses group
    h // (H // G)); D: (H,); state: (H, P, N) float32. Recurrence (float32):

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t.

    Returns y (L, H, P) in x's dtype and the final state (H, P, N) float32."""
    L, H, P = x.shape
    N = B.shape[-1]
    T = chunk_size
    pad = (-L) % T
    n = (L + pad) // T

    x32 = F.pad(x.to(torch.float32), (0, 0, 0, 0, 0, pad))  # (Lp, H, P)
    dt = F.pad(dt.to(torch.float32), (0, 0, 0, pad))  # (Lp, H); padded steps: dt = 0
    # Chunked, heads first: xdt (H, n, T, P) = dt x; Bh, Ch (H, n, T, N); a (H, n, T) = dt A.
    xdt = (x32 * dt[..., None]).permute(1, 0, 2).reshape(H, n, T, P)
    Bh, Ch = (
        F.pad(_repeat_heads(t.to(torch.float32), H), (0, 0, 0, 0, 0, pad))
        .permute(1, 0, 2)
        .reshape(H, n, T, N)
        for t in (B, C)
    )
    a = (A.to(torch.float32) * dt).t().reshape(H, n, T)
    a_cum = a.cumsum(dim=-1)  # (H, n, T): log decay from the chunk's start to each token

    # 1. Within each chunk: a causal "attention" C_i . B_j decayed from token j to token i.
    scores = (Ch @ Bh.transpose(-1, -2)) * _segsum(a).exp()  # (H, n, T, T)
    y = scores @ xdt  # (H, n, T, P)

    # 2. Each chunk's contribution to the state at its end (from a zero start).
    to_end = (a_cum[..., -1:] - a_cum).exp()  # (H, n, T)
    chunk_states = (xdt * to_end[..., None]).transpose(-1, -2) @ Bh  # (H, n, P, N)

    # 3. The state at every chunk boundary: the start state and each chunk's contribution,
    # decayed by the chunks between (one matmul over chunks instead of a loop).
    states = torch.cat([state.to(torch.float32)[:, None], chunk_states], dim=1)  # (H, n+1, P, N)
    across = _segsum(F.pad(a_cum[..., -1], (1, 0))).exp()  # (H, n+1, n+1): [to, from]
    states = (across @ states.reshape(H, n + 1, P * N)).reshape(H, n + 1, P, N)
    starts, final = states[:, :-1], states[:, -1]  # (H, n, P, N), (H, P, N)

    # 4. Each token reads its chunk's start state, decayed to it.
    y = y + (Ch @ starts.transpose(-1, -2)) * a_cum.exp()[..., None]  # (H, n, T, P)

    y = y.reshape(H, n * T, P).transpose(0, 1) + D.to(torch.float32)[:, None] * x32  # (Lp, H, P)
    return y[:L].to(x.dtype), final.contiguous()


def ssd_step(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, states: Tensor
) -> Tensor:
    """One token for each of Bn sequences: x (Bn, H, P); dt (Bn, H), already softplus-ed;
    A, D (H,); B, C (Bn, G, N); states (Bn, H, P, N) float32, updated in place.
    Returns y (Bn, H, P) in x's dtype. Computed in float32 (transformers' decode path runs the
    B, C and output products in the activations' dtype)."""
    H = x.shape[1]
    x32 = x.to(torch.float32)
    dt = dt.to(torch.float32)
    Bh = _repeat_heads(B.to(torch.float32), H)  # (Bn, H, N)
    Ch = _repeat_heads(C.to(torch.float32), H)  # (Bn, H, N)
    states.mul_(torch.exp(dt * A.to(torch.float32))[..., None, None])  # decay
    states.addcmul_(x32[..., :, None], (dt[..., None] * Bh)[:, :, None, :])  # += x (dt B)^T
    y = (states @ Ch[..., None])[..., 0]  # (Bn, H, P)
    return (y + x32 * D.to(torch.float32)[:, None]).to(x.dtype)
