"""The hybrid models' per-request-state primitives (``kernels/recurrent.py``) against
transformers 5.23's own torch code: the short conv against ``causal_conv1d_fn`` /
``causal_conv1d_update``, the gated delta rule against ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (Qwen3-Next), Mamba 2's SSD against ``mamba2_chunk_scan``
/ ``mamba2_selective_state_update`` and a float64 token-by-token recurrence; then whole mixers
(Mamba2Mixer, Qwen3-Next's and Qwen3.5's GatedDeltaNet, LFM2's ShortConv) run with a
transformers cache through prefill, a continued prefill and decode, against the same layers
recomposed from these primitives. And self-consistency: the chunked forms equal the one-token
forms applied token by token, and a sequence split into two calls (state carried) equals one
call, at lengths around the chunk size.

Bound: float32 throughout, the same ops as transformers in a different order (chunked vs
sequential sums): a few ulps per op, 2e-5 of the values' scale."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, Lfm2Config, Mamba2Config, Qwen3NextConfig
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from warmboot.kernels.recurrent import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
    ssd_chunk_scan,
    ssd_step,
)

# transformers' torch code itself, past the hub-kernel dispatch wrappers (which would pick
# fla / mamba_ssm / causal_conv1d where installed)
hf_chunk_gdr = inspect.unwrap(hf_qwen3_next.torch_chunk_gated_delta_rule)
hf_recurrent_gdr = inspect.unwrap(hf_qwen3_next.torch_recurrent_gated_delta_rule)
hf_chunk_scan = inspect.unwrap(hf_mamba2.mamba2_chunk_scan)
hf_state_update = inspect.unwrap(hf_mamba2.mamba2_selective_state_update)
hf_conv_fn = inspect.unwrap(hf_mamba2.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(hf_mamba2.causal_conv1d_update)

TOL = 2e-5


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(1.0, expected.abs().amax().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def lengths(T: int) -> list[int]:
    return sorted({1, 3, T - 1, T, 2 * T + 5})


CASES = [(T, L) for T in (4, 8, 64) for L in lengths(T)]


# --------------------------------------------------------------------------- short conv


def conv_inputs(L: int, C: int = 6, K: int = 4, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, C, generator=g)
    w = torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    state = torch.randn(C, K - 1, generator=g)
    return x, w, b, state


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("L", [1, 2, 3, 9])
def test_conv_matches_transformers(L, bias, activation):
    x, w, b, state = conv_inputs(L, bias=bias)
    # Fresh sequence: causal_conv1d_fn zero-pads on the left.
    y, _ = causal_conv1d(x, w, b, torch.zeros_like(state), activation)
    close(y, hf_conv_fn(x.t()[None], w, b, activation)[0].t())
    # Continued: transformers convolves concat(cached inputs, x) and keeps the last L outputs.
    y, new_state = causal_conv1d(x, w, b, state, activation)
    full = torch.cat([state, x.t()], dim=1)[None]
    close(y, hf_conv_fn(full, w, b, activation)[0, :, -L:].t())
    close(new_state, full[0, :, -3:])
    # One token: causal_conv1d_update keeps K inputs (the oldest unused); ours keeps K-1.
    xs, hf_states = torch.randn(2, 6), torch.randn(2, 6, 4)
    states = hf_states[:, :, 1:].clone()
    y1 = causal_conv1d_step(xs, w, b, states, activation)
    y_hf = hf_conv_update(xs[:, :, None], hf_states, w, b, activation)[:, :, 0]
    close(y1, y_hf)
    close(states, hf_states[:, :, 1:])


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("L", [1, 2, 5, 11])
def test_conv_chunked_equals_steps_and_split(K, L):
    x, w, b, state = conv_inputs(L, K=K, seed=L)
    saved = [t.clone() for t in (x, w, b, state)]
    y, final = causal_conv1d(x, w, b, state, "silu")
    for t, s in zip((x, w, b, state), saved, strict=True):
        assert torch.equal(t, s), "an input was modified"
    states = state[None].clone()
    steps = torch.stack(
        [causal_conv1d_step(x[i : i + 1], w, b, states, "silu")[0] for i in range(L)]
    )
    close(y, steps)
    close(final, states[0])
    s = L // 2
    y1, mid = causal_conv1d(x[:s], w, b, state, "silu")
    y2, end = causal_conv1d(x[s:], w, b, mid, "silu")
    close(torch.cat([y1, y2]), y)
    close(end, final)


# --------------------------------------------------------------------------- gated delta rule


def gdr_inputs(L, Hk=2, H=4, Dk=8, Dv=6, seed=0, strong_decay=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, Hk, Dk, generator=g)
    k = torch.randn(L, Hk, Dk, generator=g)
    v = torch.randn(L, H, Dv, generator=g)
    a_log = torch.empty(H).uniform_(0.01, 16 if strong_decay else 1, generator=g).log()
    decay = -a_log.exp() * F.softplus(torch.randn(L, H, generator=g))  # as the models make g
    beta = torch.randn(L, H, generator=g).sigmoid()
    state = torch.randn(H, Dk, Dv, generator=g) * 0.5
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("T,L", [(4, 9), (64, 1), (64, 70), (16, 48)])
def test_gdr_matches_transformers(T, L, strong_decay):
    q, k, v, decay, beta, state = gdr_inputs(L, seed=L, strong_decay=strong_decay)
    scale = q.shape[-1] ** -0.5
    saved = [t.clone() for t in (q, k, v, decay, beta, state)]
    o, final = chunk_gated_delta_rule(q, k, v, decay, beta, state, scale, chunk_size=T)
    for t, s in zip((q, k, v, decay, beta, state), saved, strict=True):
        assert torch.equal(t, s), "an input was modified"
    args = (q[None], k[None], v[None], decay[None], beta[None])
    kw = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hf, final_hf = hf_chunk_gdr(*args, chunk_size=T, **kw)
    close(o, o_hf[0])
    close(final, final_hf[0])
    o_hf, final_hf = hf_recurrent_gdr(*args, **kw)  # the token-by-token reference
    close(o, o_hf[0])
    close(final, final_hf[0])


def test_gdr_step_matches_transformers():
    q, k, v, decay, beta, _ = gdr_inputs(3, seed=7)  # 3 sequences of one token each
    states = torch.randn(3, 4, 8, 6)
    scale = 8**-0.5
    o_hf, final_hf = hf_recurrent_gdr(
        q[:, None],
        k[:, None],
        v[:, None],
        decay[:, None],
        beta[:, None],
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o = recurrent_gated_delta_step(q, k, v, decay, beta, states, scale)
    close(o, o_hf[:, 0])
    close(states, final_hf)


@pytest.mark.parametrize("T,L", CASES)
def test_gdr_chunked_equals_steps_and_split(T, L):
    q, k, v, decay, beta, state = gdr_inputs(L, Hk=3, H=3, seed=T * 1000 + L)
    scale = 0.3
    o, final = chunk_gated_delta_rule(q, k, v, decay, beta, state, scale, chunk_size=T)
    states = state[None].clone()
    steps = [
        recurrent_gated_delta_step(
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            decay[i : i + 1],
            beta[i : i + 1],
            states,
            scale,
        )[0]
        for i in range(L)
    ]
    close(o, torch.stack(steps))
    close(final, states[0])
    for s in {1, L // 2, L - 1} - {0, L}:
        o1, mid = chunk_gated_delta_rule(
            q[:s], k[:s], v[:s], decay[:s], beta[:s], state, scale, chunk_size=T
        )
        o2, end = chunk_gated_delta_rule(
            q[s:], k[s:], v[s:], decay[s:], beta[s:], mid, scale, chunk_size=T
        )
        close(torch.cat([o1, o2]), o)
        close(end, final)


def test_gdr_bfloat16_io():
    q, k, v, decay, beta, state = gdr_inputs(20, seed=3)
    o32, f32 = chunk_gated_delta_rule(q, k, v, decay, beta, state, 0.35, chunk_size=8)
    bf = [t.bfloat16() for t in (q, k, v)]
    o, final = chunk_gated_delta_rule(*bf, decay, beta, state, 0.35, chunk_size=8)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    close(o.float(), o32, tol=3e-2)
    close(final, f32, tol=3e-2)


# --------------------------------------------------------------------------- Mamba 2 SSD


def ssd_inputs(L, H=4, P=3, G=2, N=5, seed=0, Bn=None):
    g = torch.Generator().manual_seed(seed)
    lead = (L,) if Bn is None else (Bn,)
    x = torch.randn(*lead, H, P, generator=g)
    dt_raw = torch.randn(*lead, H, generator=g)
    dt_bias = torch.randn(H, generator=g) - 1
    A = -torch.empty(H).uniform_(1, 16, generator=g)
    B = torch.randn(*lead, G, N, generator=g)
    C = torch.randn(*lead, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(*(() if Bn is None else (Bn,)), H, P, N, generator=g)
    return x, dt_raw, dt_bias, A, B, C, D, state


def naive_ssd(x, dt, A, B, C, D, state):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = h_t C_t + D x_t, in float64."""
    x, dt, A, B, C, D, h = (t.double() for t in (x, dt, A, B, C, D, state))
    r = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(r, dim=1), C.repeat_interleave(r, dim=1)  # (L, H, N)
    ys = []
    for t in range(x.shape[0]):
        h = (
            torch.exp(dt[t] * A)[:, None, None] * h
            + (dt[t, :, None] * x[t])[..., None] * B[t, :, None]
        )
        ys.append(h @ C[t, :, :, None])
    y = torch.stack(ys)[..., 0] + D[:, None] * x
    return y.float(), h.float()


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
@pytest.mark.parametrize("T,L", [(4, 9), (8, 8), (16, 37), (256, 20)])
def test_ssd_matches_transformers(T, L, limit):
    x, dt_raw, dt_bias, A, B, C, D, state = ssd_inputs(L, seed=L)
    y_hf, final_hf = hf_chunk_scan(
        x[None],
        dt_raw[None],
        A,
        B[None],
        C[None],
        chunk_size=T,
        D=D,
        dt_bias=dt_bias,
        initial_states=state[None],
        dt_softplus=True,
        dt_limit=limit,
        return_final_states=True,
    )
    dt = F.softplus(dt_raw + dt_bias).clamp(*limit)  # the caller's part
    saved = [t.clone() for t in (x, dt, A, B, C, D, state)]
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size=T)
    for t, s in zip((x, dt, A, B, C, D, state), saved, strict=True):
        assert torch.equal(t, s), "an input was modified"
    close(y, y_hf[0])
    close(final, final_hf[0])
    y64, final64 = naive_ssd(x, dt, A, B, C, D, state)
    close(y, y64)
    close(final, final64)


def test_ssd_step_matches_transformers():
    x, dt_raw, dt_bias, A, B, C, D, states = ssd_inputs(0, seed=5, Bn=3)
    H, P, N = states.shape[1:]
    hf_states = states.clone()
    y_hf = hf_state_update(
        hf_states,
        x,
        dt_raw[..., None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B,
        C,
        D[:, None].expand(-1, P),
        dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True,
    )  # the per-head-dim expansions are Mamba2Mixer's
    y = ssd_step(x, F.softplus(dt_raw + dt_bias), A, B, C, D, states)
    close(y, y_hf)
    close(states, hf_states)


@pytest.mark.parametrize("T,L", CASES)
def test_ssd_chunked_equals_steps_and_split(T, L):
    x, dt_raw, dt_bias, A, B, C, D, state = ssd_inputs(L, H=6, G=3, seed=T * 1000 + L)
    dt = F.softplus(dt_raw + dt_bias)
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size=T)
    states = state[None].clone()
    steps = [
        ssd_step(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], D, states)[0]
        for i in range(L)
    ]
    close(y, torch.stack(steps))
    close(final, states[0])
    for s in {1, L // 2, L - 1} - {0, L}:
        y1, mid = ssd_chunk_scan(x[:s], dt[:s], A, B[:s], C[:s], D, state, chunk_size=T)
        y2, end = ssd_chunk_scan(x[s:], dt[s:], A, B[s:], C[s:], D, mid, chunk_size=T)
        close(torch.cat([y1, y2]), y)
        close(end, final)


def test_ssd_bfloat16_io():
    x, dt_raw, dt_bias, A, B, C, D, state = ssd_inputs(20, seed=4)
    dt = F.softplus(dt_raw + dt_bias)
    y32, f32 = ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size=8)
    y, final = ssd_chunk_scan(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, state, 8)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    close(y.float(), y32, tol=3e-2)
    close(final, f32, tol=3e-2)


# --------------------------------------------------------------------------- whole mixers
# Each mixer runs in transformers with a cache: a 7-token prefill, a 6-token continued
# prefill, then two decode steps; ours recomposes the layer from the primitives.

SCHEDULE = (7, 6, 1, 1)


def run_both(layer, ours, hidden: int, cache_kw: str, config) -> None:
    cache = DynamicCache(config=config)
    g = torch.Generator().manual_seed(11)
    state = None
    with torch.no_grad():
        for n in SCHEDULE:
            h = torch.randn(1, n, hidden, generator=g)
            expected = layer(h, **{cache_kw: cache})[0]
            actual, state = ours(h[0], state)
            close(actual, expected)


def randomise(*params: torch.nn.Parameter, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def test_mamba2_mixer():
    cfg = Mamba2Config(
        hidden_size=16,
        num_heads=4,
        head_dim=8,
        expand=2,
        state_size=6,
        n_groups=2,
        chunk_size=4,
        conv_kernel=4,
        num_hidden_layers=1,
        vocab_size=8,
    )
    m = Mamba2Mixer(cfg, 0).eval()
    randomise(m.dt_bias, m.D, m.norm.weight)
    H, P, G, N, inner = 4, 8, 2, 6, 32
    conv_dim = inner + 2 * G * N

    def ours(h, state):
        conv, ssm = state or (torch.zeros(conv_dim, 3), torch.zeros(H, P, N))
        # in_proj -> [gate z (inner) | xBC (inner + 2 G N), convolved | dt (H)]
        z, xbc, dt = m.in_proj(h).split([inner, conv_dim, H], dim=-1)
        w, b = m.conv1d.weight[:, 0], m.conv1d.bias
        dt = F.softplus(dt + m.dt_bias)  # decode: transformers does not apply time_step_limit
        A = -torch.exp(m.A_log.float())
        if h.shape[0] == 1 and state is not None:
            states = conv[None].clone()
            xbc = causal_conv1d_step(xbc, w, b, states, "silu")
            conv = states[0]
            x, B, C = xbc.split([inner, G * N, G * N], dim=-1)
            ssm = ssm[None].clone()
            y = ssd_step(x.view(1, H, P), dt, A, B.view(1, G, N), C.view(1, G, N), m.D, ssm)
            ssm = ssm[0]
        else:
            xbc, conv = causal_conv1d(xbc, w, b, conv, "silu")
            x, B, C = xbc.split([inner, G * N, G * N], dim=-1)
            L = h.shape[0]
            dt = dt.clamp(*cfg.time_step_limit)
            y, ssm = ssd_chunk_scan(
                x.view(L, H, P), dt, A, B.view(L, G, N), C.view(L, G, N), m.D, ssm, cfg.chunk_size
            )
        # gated RMSNorm: y * silu(z) first, then RMS over each of the n_groups slices
        y = m.norm(y.reshape(h.shape[0], inner), z)
        return m.out_proj(y), (conv, ssm)

    run_both(m, ours, 16, "cache_params", cfg)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gated_deltanet_mixer(family):
    Hk, H, Dk, Dv, K = 2, 4, 8, 6, 4
    kw = dict(
        hidden_size=16,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=8,
        linear_num_key_heads=Hk,
        linear_num_value_heads=H,
        linear_key_head_dim=Dk,
        linear_value_head_dim=Dv,
        linear_conv_kernel_dim=K,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**kw)
        m = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    else:
        cfg = Qwen3_5TextConfig(**kw)
        m = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    randomise(m.dt_bias, m.norm.weight)
    r = H // Hk

    def project(h):
        L = h.shape[0]
        if family == "qwen3_next":
            # in_proj_qkvz grouped per key head: [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] x Hk;
            # in_proj_ba per key head: [b (r) | a (r)] x Hk
            qkvz = m.in_proj_qkvz(h).view(L, Hk, 2 * Dk + 2 * r * Dv)
            q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
            b, a = m.in_proj_ba(h).view(L, Hk, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(L, -1), k.reshape(L, -1), v.reshape(L, -1)], dim=-1)
            return mixed, z.reshape(L, H, Dv), b.reshape(L, H), a.reshape(L, H)
        # Qwen3.5: separate flat projections; in_proj_qkv = [q (Hk Dk) | k (Hk Dk) | v (H Dv)]
        z = m.in_proj_z(h).view(L, H, Dv)
        return m.in_proj_qkv(h), z, m.in_proj_b(h), m.in_proj_a(h)

    def ours(h, state):
        conv, S = state or (torch.zeros(2 * Hk * Dk + H * Dv, K - 1), torch.zeros(H, Dk, Dv))
        L = h.shape[0]
        mixed, z, b, a = project(h)
        w = m.conv1d.weight[:, 0]  # no conv bias; silu
        if L == 1 and state is not None:
            states = conv[None].clone()
            mixed = causal_conv1d_step(mixed, w, None, states, "silu")
            conv = states[0]
        else:
            mixed, conv = causal_conv1d(mixed, w, None, conv, "silu")
        q, k, v = mixed.split([Hk * Dk, Hk * Dk, H * Dv], dim=-1)
        q, k, v = q.view(L, Hk, Dk), k.view(L, Hk, Dk), v.view(L, H, Dv)
        beta = b.sigmoid()
        decay = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        if L == 1 and state is not None:
            states = S[None].clone()
            o = recurrent_gated_delta_step(q, k, v, decay, beta, states, Dk**-0.5)
            S = states[0]
        else:
            o, S = chunk_gated_delta_rule(q, k, v, decay, beta, S, Dk**-0.5)
        # gated RMSNorm per value head (Dv), norm before gate: w * norm(o) * silu(z)
        o = m.norm(o.reshape(-1, Dv), z.reshape(-1, Dv)).reshape(L, H * Dv)
        return m.out_proj(o), (conv, S)

    run_both(m, ours, 16, "cache_params", cfg)


def test_lfm2_short_conv():
    cfg = Lfm2Config(
        hidden_size=16,
        num_hidden_layers=1,
        layer_types=["conv"],
        vocab_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        conv_bias=True,
    )
    m = Lfm2ShortConv(cfg, 0).eval()
    K = cfg.conv_L_cache  # the kernel size

    def ours(h, state):
        conv = torch.zeros(16, K - 1) if state is None else state
        B, C, x = m.in_proj(h).chunk(3, dim=-1)  # in_proj -> [B | C | x]
        w, b = m.conv.weight[:, 0], m.conv.bias  # no activation
        if h.shape[0] == 1 and state is not None:
            states = conv[None].clone()
            y = causal_conv1d_step(B * x, w, b, states, None)
            conv = states[0]
        else:
            y, conv = causal_conv1d(B * x, w, b, conv, None)
        return m.out_proj(C * y), conv

    run_both(m, ours, 16, "past_key_values", cfg)


def test_empty_sequences():
    """A zero-length prefill returns no rows and the state unchanged, as a new tensor."""
    x, w, b, state = conv_inputs(0)
    y, new = causal_conv1d(x, w, b, state, "silu")
    assert y.shape == (0, 6) and torch.equal(new, state) and new is not state
    q, k, v, decay, beta, state = gdr_inputs(0)
    o, new = chunk_gated_delta_rule(q, k, v, decay, beta, state, 0.3, chunk_size=8)
    assert o.shape == (0, 4, 6) and torch.equal(new, state) and new is not state
    x, dt_raw, dt_bias, A, B, C, D, state = ssd_inputs(0)
    y, new = ssd_chunk_scan(x, dt_raw.exp(), A, B, C, D, state, chunk_size=8)
    assert y.shape == (0, 4, 3) and torch.equal(new, state) and new is not state
