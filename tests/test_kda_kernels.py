"""Kimi Delta Attention's recurrence (``chunk_kda``, ``recurrent_kda_step`` in
``kernels/recurrent.py``): against a float64 token-by-token loop, against transformers
5.23's own torch code (``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``),
the chunked form against the one-token form and against itself split in two (state carried),
at lengths around the chunk size, with mild and strong per-channel decays. Then the whole
layer (``layers.kda.KimiDeltaAttention``, through ``state_ops``' eager path) against
transformers' ``KimiLinearDeltaAttention`` with a cache: prefill, continued prefill, decode.

Bound: float32, the same ops in a different order: 2e-5 of the values' scale."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from warmboot.kernels.recurrent import chunk_kda, recurrent_kda_step
from warmboot.models.layers.kda import KimiDeltaAttention

TOL = 2e-5
CASES = [(T, L) for T in (4, 8, 64) for L in sorted({1, 3, T - 1, T, 2 * T + 5})]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(1.0, expected.abs().amax().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def kda_inputs(L, H=3, Dk=8, Dv=6, seed=0, strong_decay=False, batch=None):
    """(L, ...) tensors of one sequence, or (batch, ...) rows of one token each. The decay as
    the model makes it: ``-exp(A_log) * softplus(f)`` per head and key channel."""
    g = torch.Generator().manual_seed(seed)
    n = L if batch is None else batch
    q = torch.randn(n, H, Dk, generator=g)
    k = torch.randn(n, H, Dk, generator=g)
    v = torch.randn(n, H, Dv, generator=g)
    a_log = torch.empty(H, 1).uniform_(1, 16 if strong_decay else 1.5, generator=g).log()
    decay = -a_log.exp() * F.softplus(torch.randn(n, H, Dk, generator=g) - 2)
    beta = torch.randn(n, H, generator=g).sigmoid()
    shape = (H, Dk, Dv) if batch is None else (batch, H, Dk, Dv)
    state = torch.randn(*shape, generator=g) * 0.5
    return q, k, v, decay, beta, state


def naive_kda(q, k, v, g, beta, state, scale):
    """The recurrence in float64, one token at a time (as the docstring of ``chunk_kda``)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() * scale
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    S, out = state.double().clone(), []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]  # (H, Dk, Dv): row d decays by exp(g[t, h, d])
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
        S = S + k[t][..., None] * delta[:, None]
        out.append(torch.einsum("hk,hkv->hv", q[t], S))
    return torch.stack(out).float(), S.float()


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("T,L", CASES)
def test_kimi_chunked_matches_float64_loop(T, L, strong_decay):
    q, k, v, decay, beta, state = kda_inputs(L, seed=T * 100 + L, strong_decay=strong_decay)
    saved = [t.clone() for t in (q, k, v, decay, beta, state)]
    o, final = chunk_kda(q, k, v, decay, beta, state, 0.3, chunk_size=T)
    for t, s in zip((q, k, v, decay, beta, state), saved, strict=True):
        assert torch.equal(t, s), "an input was modified"
    o_ref, final_ref = naive_kda(q, k, v, decay, beta, state, 0.3)
    close(o, o_ref)
    close(final, final_ref)


def test_kimi_step_matches_float64_loop():
    q, k, v, decay, beta, states = kda_inputs(1, seed=5, batch=4)  # 4 sequences, one token
    expected = [
        naive_kda(*(t[b : b + 1] for t in (q, k, v, decay, beta)), states[b], 0.4) for b in range(4)
    ]
    o = recurrent_kda_step(q, k, v, decay, beta, states, 0.4)
    close(o, torch.cat([e[0] for e in expected]))
    close(states, torch.stack([e[1] for e in expected]))


@pytest.mark.parametrize("T,L", CASES)
def test_kimi_chunked_equals_steps_and_split(T, L):
    q, k, v, decay, beta, state = kda_inputs(L, seed=T * 1000 + L, strong_decay=True)
    o, final = chunk_kda(q, k, v, decay, beta, state, 0.3, chunk_size=T)
    states = state[None].clone()
    rows = (q, k, v, decay, beta)
    steps = [recurrent_kda_step(*(t[i : i + 1] for t in rows), states, 0.3)[0] for i in range(L)]
    close(o, torch.stack(steps))
    close(final, states[0])
    for s in {1, L // 2, L - 1} - {0, L}:
        o1, mid = chunk_kda(*(t[:s] for t in rows), state, 0.3, chunk_size=T)
        o2, end = chunk_kda(*(t[s:] for t in rows), mid, 0.3, chunk_size=T)
        close(torch.cat([o1, o2]), o)
        close(end, final)


def test_kimi_empty_and_bfloat16():
    q, k, v, decay, beta, state = kda_inputs(20, seed=3)
    o, final = chunk_kda(q[:0], k[:0], v[:0], decay[:0], beta[:0], state, 0.35)
    assert o.shape == (0, 3, 6) and torch.equal(final, state)
    o32, f32 = chunk_kda(q, k, v, decay, beta, state, 0.35, chunk_size=8)
    bf = [t.bfloat16() for t in (q, k, v)]
    o, final = chunk_kda(*bf, decay, beta, state, 0.35, chunk_size=8)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    close(o.float(), o32, tol=3e-2)
    close(final, f32, tol=3e-2)


# --------------------------------------------------------------------------- transformers
HF_KW = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.fixture(scope="module")
def hf_kimi():
    """transformers' Kimi Linear code, imported when a test runs: at collection its hub-kernel
    imports would load triton before the Triton tests set ``TRITON_INTERPRET``."""
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


@pytest.fixture(scope="module")
def hf_fns(hf_kimi):
    """Its torch functions themselves, past the hub-kernel wrappers (fla where installed)."""
    unwrap = inspect.unwrap
    return unwrap(hf_kimi.chunk_kimi_delta_attention), unwrap(
        hf_kimi.recurrent_kimi_delta_attention
    )


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("T,L", [(4, 9), (64, 1), (64, 70), (16, 48)])
def test_kimi_chunked_matches_transformers(T, L, strong_decay, hf_fns):
    hf_chunk, hf_recurrent = hf_fns
    Dk = 8
    q, k, v, decay, beta, state = kda_inputs(L, Dk=Dk, seed=L, strong_decay=strong_decay)
    o, final = chunk_kda(q, k, v, decay, beta, state, 1 / Dk**0.5, chunk_size=T)
    args = (q[None], k[None], v[None], decay[None], beta[None])
    o_hf, final_hf = hf_chunk(*args, chunk_size=T, initial_state=state[None], **HF_KW)
    close(o, o_hf[0])
    close(final, final_hf[0])
    o_hf, final_hf = hf_recurrent(*args, initial_state=state[None], **HF_KW)
    close(o, o_hf[0])
    close(final, final_hf[0])


def test_kimi_step_matches_transformers(hf_fns):
    hf_recurrent = hf_fns[1]
    Dk = 8
    q, k, v, decay, beta, states = kda_inputs(1, Dk=Dk, seed=7, batch=3)
    args = (t[:, None] for t in (q, k, v, decay, beta))
    o_hf, final_hf = hf_recurrent(*args, initial_state=states, **HF_KW)
    o = recurrent_kda_step(q, k, v, decay, beta, states, 1 / Dk**0.5)
    close(o, o_hf[:, 0])
    close(states, final_hf)


def _ours_from(m, cfg) -> KimiDeltaAttention:
    """Our layer with transformers' layer's weights, as the loader would stack them."""
    ours = KimiDeltaAttention(
        cfg.hidden_size,
        cfg.linear_num_heads,
        cfg.linear_head_dim,
        cfg.linear_conv_kernel_dim,
        cfg.rms_norm_eps,
    )
    fg = m.forget_gate
    parts = (m.q_proj, m.k_proj, m.v_proj, fg.f_a_proj, m.g_a_proj, m.b_proj)
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([p.weight for p in parts]))
        ours.conv1d.weight.copy_(m.conv1d.weight)
        ours.f_b_proj.weight.copy_(fg.f_b_proj.weight)
        ours.g_b_proj.weight.copy_(m.g_b_proj.weight)
        ours.A_log.copy_(fg.A_log.reshape(-1))
        ours.dt_bias.copy_(fg.dt_bias)
        ours.o_norm.weight.copy_(m.o_norm.weight)
        ours.o_proj.weight.copy_(m.o_proj.weight)
    return ours.eval()


def _step(n: int, decode: bool, states: dict) -> SimpleNamespace:
    """The slice of a ``StepContext`` the state ops read: one sequence in slot 0."""
    prefills = [] if decode else [SimpleNamespace(query_start=0, query_len=n)]
    meta = SimpleNamespace(
        num_decode_tokens=n if decode else 0,
        decode_state_slots=torch.tensor([0]),
        prefills=prefills,
        state_slots=[0],
        state_saves=[],
    )
    return SimpleNamespace(layer=0, states=[states], meta=meta)


def test_kimi_layer_matches_transformers(hf_kimi):
    from transformers import DynamicCache, KimiLinearConfig

    cfg = KimiLinearConfig(
        hidden_size=16,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        vocab_size=8,
        linear_num_heads=3,
        linear_head_dim=6,
        linear_conv_kernel_dim=3,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    m = hf_kimi.KimiLinearDeltaAttention(cfg, 0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        m.forget_gate.A_log.copy_(torch.empty(1, 1, 3, 1).uniform_(1, 16, generator=g).log())
    ours = _ours_from(m, cfg)
    conv, recurrent = (s.shape for s in ours.state_specs())
    states = {"conv": torch.zeros(1, *conv), "recurrent": torch.zeros(1, *recurrent)}
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        for n, decode in ((7, False), (6, False), (1, True), (1, True)):
            h = torch.randn(1, n, 16, generator=g)
            expected = m(h, cache_params=cache)[0]
            actual = ours(h[0], torch.arange(n), _step(n, decode, states))
            close(actual, expected)
