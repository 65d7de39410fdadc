"""Mamba 1's selective scan (``kernels/selective_scan.py``) and mixer (``layers/mamba1.py``).

The chunked scan and the one-token step against a float64 token loop (strong decays, a
saved start state, lengths around the chunk), a prefill split into two calls (the state
carried) against one call, and against transformers 5.23's own torch functions
(``mamba_selective_scan`` / ``mamba_selective_state_update``). Then the whole mixer as
warmboot runs it (``warmboot::selective_scan`` and ``causal_conv`` over state slots, two
sequences per step) against transformers' Mamba, FalconMamba and Jamba mixers with their
cache: a prefill, then decode steps. transformers' torch scan always starts from zeros, so a
prefill continued from a saved state is checked against our own one-call prefill.

Bound: float32, the same ops in another order (a log-depth scan instead of a token loop):
1e-5 of the values' scale against float64; 2e-5 against transformers' float32."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.backend import AttentionMetadata, PrefillSeq
from warmboot.kernels.selective_scan import selective_scan_chunk, selective_scan_step
from warmboot.kernels.step_ops import StepContext
from warmboot.models.layers.mamba1 import Mamba1Mixer
from warmboot.models.registry import model_class


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    expected = expected.to(actual.dtype)
    scale = max(1.0, expected.abs().amax().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def scan_inputs(L: int, inner: int = 6, S: int = 5, seed: int = 0, rows: int | None = None):
    """x, dt (softplus'd, up to ~5: strong decays), A (-1 .. -S and beyond), B, C, D and a
    non-zero start state; ``rows``: a batch of one-token rows (the step's shapes)."""
    g = torch.Generator().manual_seed(seed)
    n = L if rows is None else rows
    x = torch.randn(n, inner, generator=g)
    dt = F.softplus(torch.randn(n, inner, generator=g) * 2 + 0.5)
    A = -torch.exp(
        torch.log(torch.arange(1.0, S + 1)).expand(inner, S)
        + 0.3 * torch.rand(inner, S, generator=g)
    )
    B, C = torch.randn(n, S, generator=g), torch.randn(n, S, generator=g)
    D = torch.randn(inner, generator=g)
    shape = (inner, S) if rows is None else (rows, inner, S)
    state = torch.randn(shape, generator=g)
    return x, dt, A, B, C, D, state


def loop64(x, dt, A, B, C, D, state):
    """The recurrence token by token in float64: (y (L, inner), final state)."""
    x, dt, A, B, C, D, h = (t.double() for t in (x, dt, A, B, C, D, state))
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t, :, None] * A) * h + dt[t, :, None] * B[t] * x[t, :, None]
        ys.append(h @ C[t] + D * x[t])
    y = torch.stack(ys) if ys else x.new_empty(0, x.shape[1])
    return y, h


@pytest.mark.parametrize("T", [1, 4, 8, 64])
@pytest.mark.parametrize("L", [1, 3, 7, 8, 21])
def test_chunk_matches_a_float64_loop(T, L):
    x, dt, A, B, C, D, state = scan_inputs(L, seed=T * 100 + L)
    y, final = selective_scan_chunk(x, dt, A, B, C, D, state, chunk_size=T)
    y64, final64 = loop64(x, dt, A, B, C, D, state)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    close(y, y64, 1e-5)
    close(final, final64, 1e-5)


def test_step_matches_a_float64_loop():
    x, dt, A, B, C, D, states = scan_inputs(0, seed=3, rows=3)
    start = states.clone()
    y = selective_scan_step(x, dt, A, B, C, D, states)
    for i in range(3):
        y64, h64 = loop64(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], D, start[i])
        close(y[i], y64[0], 1e-5)
        close(states[i], h64, 1e-5)


@pytest.mark.parametrize("T", [4, 8])
def test_two_chunks_equal_one(T):
    """A prefill split anywhere (the state carried between the calls) equals one call."""
    L = 2 * T + 3
    x, dt, A, B, C, D, state = scan_inputs(L, seed=T)
    y, final = selective_scan_chunk(x, dt, A, B, C, D, state, chunk_size=T)
    for s in (1, T - 1, T, T + 2, L - 1):
        y1, mid = selective_scan_chunk(x[:s], dt[:s], A, B[:s], C[:s], D, state, chunk_size=T)
        y2, end = selective_scan_chunk(x[s:], dt[s:], A, B[s:], C[s:], D, mid, chunk_size=T)
        close(torch.cat([y1, y2]), y, 1e-5)
        close(end, final, 1e-5)


def test_matches_transformers_functions():
    from transformers.models.mamba import modeling_mamba as hf

    hf_scan = inspect.unwrap(hf.mamba_selective_scan)
    hf_update = inspect.unwrap(hf.mamba_selective_state_update)
    L, inner, S = 13, 6, 5
    x, dt, A, B, C, D, _ = scan_inputs(L, inner, S, seed=9)
    zero = torch.zeros(inner, S)
    y, final = selective_scan_chunk(x, dt, A, B, C, D, zero, chunk_size=4)
    # transformers' layout: (batch, channels, L) and (batch, S, L); a zero start
    y_hf, final_hf = hf_scan(
        x.t()[None], dt.t()[None], A, B.t()[None], C.t()[None], D, return_last_state=True
    )
    close(y, y_hf[0].t(), 2e-5)
    close(final, final_hf[0], 2e-5)
    states = final[None].repeat(2, 1, 1)
    hf_states = states.clone()
    x1, dt1, _, B1, C1, _, _ = scan_inputs(0, inner, S, seed=10, rows=2)
    y = selective_scan_step(x1, dt1, A, B1, C1, D, states)
    close(y, hf_update(hf_states, x1, dt1, A, B1, C1, D), 2e-5)
    close(states, hf_states, 2e-5)


# --------------------------------------------------------------------------- the whole mixer


def hf_mixer(family: str):
    """transformers' mixer of ``family`` (layer 0 of a one-layer config), its norms and D
    moved off their defaults, and its config."""
    import transformers

    common = dict(hidden_size=16, num_hidden_layers=1, vocab_size=8)
    if family == "jamba":
        cfg = transformers.JambaConfig(
            **common,
            num_attention_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=5,
            mamba_d_conv=3,
            mamba_dt_rank=3,
            mamba_proj_bias=True,
        )
        mixer = transformers.models.jamba.modeling_jamba.JambaMambaMixer(cfg, 0)
    else:
        kw = dict(state_size=5, conv_kernel=3, time_step_rank=3, use_bias=True)
        cfg = getattr(
            transformers, "FalconMambaConfig" if family == "falcon_mamba" else "MambaConfig"
        )(**common, **kw)
        mixer = transformers.AutoModelForCausalLM.from_config(cfg).backbone.layers[0].mixer
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name.endswith(("norm.weight", "D", "bias")):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return mixer.eval(), cfg


def ours_from(hf, family: str) -> Mamba1Mixer:
    norm = {"jamba": "weighted", "falcon_mamba": "weightless"}.get(family)
    eps = getattr(hf.config, "mixer_rms_eps", getattr(hf.config, "rms_norm_eps", 1e-6))
    ours = Mamba1Mixer(
        hf.hidden_size,
        inner=hf.intermediate_size,
        d_state=hf.ssm_state_size,
        dt_rank=hf.time_step_rank,
        conv_kernel=hf.conv_kernel_size,
        conv_bias=True,
        proj_bias=True,
        bcdt_norm=norm,
        eps=eps,
    )
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours.eval()


def step_over(mixer: Mamba1Mixer, states: dict, decodes: list, prefills: list) -> StepContext:
    """A step of ``decodes`` (slots, one token each) then ``prefills`` ((slot, length), ...)."""
    d, start, seqs = len(decodes), len(decodes), []
    for _, n in prefills:
        seqs.append(PrefillSeq(start, n, n, torch.zeros(1, dtype=torch.long)))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(start, dtype=torch.long),
        num_decode_tokens=d,
        decode_block_tables=None,
        decode_seq_lens=None,
        prefills=seqs,
        block_size=4,
        state_slots=[*decodes, *(s for s, _ in prefills)],
        decode_state_slots=torch.tensor(decodes, dtype=torch.long) if d else None,
    )
    return StepContext(None, [], meta, [], states=[states])


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba"])
def test_mixer_matches_transformers(family):
    """Two sequences (slots 1 and 2) through one warmboot step each: a 9-token prefill of the
    one (split 5 + 4 over two steps) beside a 6-token prefill, then three decode steps of both
    rows together; transformers runs each sequence alone with its cache."""
    from transformers import DynamicCache

    hf, cfg = hf_mixer(family)
    ours = ours_from(hf, family)
    states = {s.name: torch.zeros(3, *s.shape) for s in ours.state_specs()}
    g = torch.Generator().manual_seed(5)
    seqs = [
        torch.randn(12, hf.hidden_size, generator=g),
        torch.randn(9, hf.hidden_size, generator=g),
    ]
    with torch.no_grad():
        expected = []
        for h, n in zip(seqs, (9, 6), strict=True):
            cache = DynamicCache(config=cfg)
            outs = [hf(h[None, :n], cache_params=cache)[0]]
            outs += [hf(h[None, t : t + 1], cache_params=cache)[0] for t in range(n, n + 3)]
            expected.append(torch.cat(outs))
        a, b = seqs
        first = ours(torch.cat([a[:5], b[:6]]), None, step_over(ours, states, [], [(1, 5), (2, 6)]))
        second = ours(a[5:9], None, step_over(ours, states, [], [(1, 4)]))
        close(torch.cat([first[:5], second]), expected[0][:9], 2e-5)
        close(first[5:], expected[1][:6], 2e-5)
        for t in range(3):
            rows = torch.stack([a[9 + t], b[6 + t]])
            y = ours(rows, None, step_over(ours, states, [1, 2], []))
            close(y[0], expected[0][9 + t], 2e-5)
            close(y[1], expected[1][6 + t], 2e-5)


@pytest.mark.parametrize(
    ("arch", "change", "expected"),
    [
        ("MambaForCausalLM", dict(hidden_act="gelu"), "conv activation 'gelu'"),
        ("JambaForCausalLM", dict(attn_layer_offset=3, attn_layer_period=3), "attn_layer_offset 3"),
    ],
)
def test_unserved_settings_are_refused_by_name(arch, change, expected):
    cfg = dict(
        architectures=[arch],
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=2,
    )
    if arch == "MambaForCausalLM":
        del cfg["num_attention_heads"]
    config = ModelConfig.from_dict(cfg | change)
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match=expected):
        model_class(arch)(config)
