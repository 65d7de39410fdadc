"""MiniMax's lightning attention (``kernels/lightning.py``): the chunked prefill and the
one-token step against a float64 token-by-token loop, against each other and against
themselves split in two (state carried), at lengths around the chunk size, with weak and
strong decays; then the whole layer (``layers.lightning.LightningAttention``, through
``state_ops``' eager path) against transformers' ``MiniMaxLightningAttention`` with its cache:
a prefill (its block-wise form), a continued prefill and decode steps (its token loop), and
one prefill split in two against transformers' in one. Last, the family's refusals.

Bound: float32, the same sums in another order: 2e-5 of the values' scale."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from warmboot.architectures import UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.kernels.lightning import lightning_prefill, lightning_step, slopes
from warmboot.models.layers.lightning import LightningAttention
from warmboot.models.loader import build_model

TOL = 2e-5
CASES = [(T, L) for T in (4, 8, 64) for L in sorted({1, 3, T - 1, T, 2 * T + 5})]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(1.0, expected.abs().amax().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def inputs(L, H=4, D=6, seed=0, strong=False, batch=None):
    """q, k, v (L or batch, H, D), a state and the slopes: MiniMax's for a middle layer, or
    strong ones (a head's state gone within a few tokens; exp(-slope * 64) underflows)."""
    g = torch.Generator().manual_seed(seed)
    n = L if batch is None else batch
    q, k, v = (torch.randn(n, H, D, generator=g) for _ in range(3))
    shape = (H, D, D) if batch is None else (batch, H, D, D)
    state = torch.randn(*shape, generator=g)
    slope = torch.tensor([3.0, 20.0, 0.5, 1e-5][:H]) if strong else slopes(H, 1, 4)
    return q, k, v, state, slope


def naive(q, k, v, state, slope):
    """The recurrence in float64, one token at a time: S = a S + k v^T, o = S^T q."""
    a = torch.exp(-slope.double())[:, None, None]
    S, out = state.double().clone(), []
    for t in range(q.shape[0]):
        S = a * S + k[t].double()[..., None] * v[t].double()[:, None]
        out.append(torch.einsum("hk,hkv->hv", q[t].double(), S))
    return torch.stack(out).float(), S.float()


@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("T,L", CASES)
def test_chunked_matches_float64_loop(T, L, strong):
    q, k, v, state, slope = inputs(L, seed=T * 100 + L, strong=strong)
    saved = [t.clone() for t in (q, k, v, state)]
    o, final = lightning_prefill(q, k, v, state, slope, chunk=T)
    for t, s in zip((q, k, v, state), saved, strict=True):
        assert torch.equal(t, s), "an input was modified"
    o_ref, final_ref = naive(q, k, v, state, slope)
    close(o, o_ref)
    close(final, final_ref)


def test_step_matches_float64_loop():
    q, k, v, states, slope = inputs(1, seed=5, batch=3)  # 3 sequences, one token each
    expected = [naive(q[b : b + 1], k[b : b + 1], v[b : b + 1], states[b], slope) for b in range(3)]
    o = lightning_step(q, k, v, states, slope)
    close(o, torch.cat([e[0] for e in expected]))
    close(states, torch.stack([e[1] for e in expected]))


@pytest.mark.parametrize("T,L", CASES)
def test_chunked_equals_steps_and_split(T, L):
    q, k, v, state, slope = inputs(L, seed=T * 1000 + L)
    o, final = lightning_prefill(q, k, v, state, slope, chunk=T)
    states = state[None].clone()
    steps = [
        lightning_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], states, slope)[0] for i in range(L)
    ]
    close(o, torch.stack(steps))
    close(final, states[0])
    for s in {1, L // 2, L - 1} - {0, L}:
        o1, mid = lightning_prefill(q[:s], k[:s], v[:s], state, slope, chunk=T)
        o2, end = lightning_prefill(q[s:], k[s:], v[s:], mid, slope, chunk=T)
        close(torch.cat([o1, o2]), o)
        close(end, final)


def test_empty_and_bfloat16():
    q, k, v, state, slope = inputs(20, seed=3)
    o, final = lightning_prefill(q[:0], k[:0], v[:0], state, slope)
    assert o.shape == (0, 4, 6) and torch.equal(final, state)
    o32, f32 = lightning_prefill(q, k, v, state, slope, chunk=8)
    o, final = lightning_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), state, slope, chunk=8)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    close(o.float(), o32, tol=3e-2)
    close(final, f32, tol=3e-2)


def test_slopes_are_transformers():
    hf = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    cfg = _hf_config()
    for layer in range(cfg.num_hidden_layers):
        expected = hf.MiniMaxLightningAttention(cfg, layer).slope_rate.reshape(-1)
        assert torch.equal(slopes(cfg.num_attention_heads, layer, cfg.num_hidden_layers), expected)


# --------------------------------------------------------------------------- transformers
def _hf_config(**kwargs):
    from transformers import MiniMaxConfig

    base = dict(
        hidden_size=20,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=8,
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        block_size=8,  # NOTE: transformers' block-wise prefill crosses its blocks
        vocab_size=8,
    )
    return MiniMaxConfig(**(base | kwargs))


def _pair(layer: int):
    """transformers' lightning layer with random weights, and ours with the same."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = _hf_config()
    torch.manual_seed(0)
    m = MiniMaxLightningAttention(cfg, layer).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    heads, d = cfg.num_attention_heads, cfg.head_dim
    ours = LightningAttention(cfg.hidden_size, heads, d, layer, cfg.num_hidden_layers, "silu")
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([m.qkv_proj.weight, m.output_gate.weight]))
        ours.norm.weight.copy_(m.norm.weight)
        ours.out_proj.weight.copy_(m.out_proj.weight)
    return m, ours.eval(), g


def _step(n: int, decode: bool, states: dict) -> SimpleNamespace:
    """The slice of a ``StepContext`` the state ops read: one sequence in slot 0."""
    prefills = [] if decode else [SimpleNamespace(query_start=0, query_len=n)]
    meta = SimpleNamespace(
        num_decode_tokens=n if decode else 0,
        decode_state_slots=torch.tensor([0]),
        prefills=prefills,
        state_slots=[0],
        state_saves=None,
    )
    return SimpleNamespace(layer=0, states=[states], meta=meta)


def _fresh(ours: LightningAttention) -> dict:
    (spec,) = ours.state_specs()
    return {"recurrent": torch.zeros(1, *spec.shape)}


@pytest.mark.parametrize("layer", [1, 2])
def test_layer_matches_transformers_with_its_cache(layer):
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    m, ours, g = _pair(layer)
    states, cache = _fresh(ours), MiniMaxCache()
    with torch.no_grad():
        for n, decode in ((19, False), (6, False), (1, True), (1, True), (1, True)):
            h = torch.randn(1, n, 20, generator=g)
            expected, hf_state = m(h, None, None, past_key_values=cache)
            actual = ours(h[0], torch.arange(n), _step(n, decode, states))
            close(actual, expected[0])
            close(states["recurrent"], hf_state)


def test_a_prefill_split_in_two_matches_transformers_in_one():
    m, ours, g = _pair(1)
    h = torch.randn(1, 30, 20, generator=g)
    states, parts = _fresh(ours), []
    with torch.no_grad():
        expected, hf_state = m(h, None, None)  # NOTE: no cache: its block-wise form throughout
        for start, end in ((0, 13), (13, 30)):
            step = _step(end - start, False, states)
            parts.append(ours(h[0, start:end], torch.arange(start, end), step))
    close(torch.cat(parts), expected[0])
    close(states["recurrent"], hf_state)


# --------------------------------------------------------------------------- the family
_CONFIG = dict(
    architectures=["MiniMaxForCausalLM"],
    vocab_size=32,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=24,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["full_attention", "linear_attention"],
)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(rotary_dim=4), "rotary_dim 4, head_dim 8"),
        (dict(postnorm=False), "postnorm false"),
        (dict(shared_intermediate_size=64), "shared_intermediate_size"),
        (dict(layer_types=["full_attention", "mamba"]), r"MiniMax layer kind\(s\) \['mamba'\]"),
    ],
)
def test_unserved_settings_are_refused_by_name(change, expected):
    build_model(ModelConfig.from_dict(_CONFIG))  # NOTE: as given, served
    with pytest.raises(UnsupportedModelError, match=expected):
        build_model(ModelConfig.from_dict(_CONFIG | change))


def test_the_layout_declares_one_state_per_lightning_layer():
    layout = build_model(ModelConfig.from_dict(_CONFIG)).kv_layout()
    assert layout.kinds == ("attention", "lightning")
    assert [[(s.name, s.shape, s.float32) for s in st] for st in layout.states] == [
        [],
        [("recurrent", (2, 8, 8), True)],
    ]
