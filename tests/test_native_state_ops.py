"""The state layers' native decode steps (``kernels/state_steps.py``, ``csrc/state_step.cpp``
and ``csrc/conv_step.cpp``) against the torch steps of ``kernels/recurrent.py`` on gathered
rows (float32: a few ulps, the same ops in another summation order) and against a float64
reference of the recurrence, on every instruction set the CPU runs: slots in no particular
order, batch 1 and 5, odd head dimensions, grouped heads, rows outside the slots untouched.
Then the ops' decode rows (``state_ops``) take the native path where it applies and the torch
path where it does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from warmboot.kernels import native, recurrent, state_ops, state_steps

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
ROWS = 8
SLOTS = {1: [5], 5: [6, 0, 3, 7, 1]}


@pytest.fixture(params=["avx2", "portable"])
def isa(request):
    best = torch.ops.warmboot_cpu.isa()
    if request.param == "avx2" and best == "portable":
        pytest.skip("this CPU cannot run avx2")
    torch.ops.warmboot_cpu.use_isa(request.param)
    yield request.param
    torch.ops.warmboot_cpu.use_isa(best)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6) -> None:
    """Within rtol of the values' scale (elementwise relative is meaningless near zero)."""
    scale = b.abs().max().item()
    assert (a.double() - b.double()).abs().max().item() <= rtol * max(scale, 1.0)


def untouched(before: torch.Tensor, after: torch.Tensor, slots: list[int]) -> None:
    others = [r for r in range(before.shape[0]) if r not in slots]
    assert torch.equal(after[others], before[others])


def delta_reference(q, k, v, g, beta, states, scale, per_channel: bool):
    """The recurrence in float64, one head at a time (states updated in place)."""
    B, H, _ = v.shape
    q = q.double().repeat_interleave(H // q.shape[1], dim=1)
    k = k.double().repeat_interleave(H // k.shape[1], dim=1)
    q, k = (F.normalize(t, dim=-1, eps=0) for t in (q, k))  # eps 1e-6 is below float64 noise
    out = torch.empty(B, H, v.shape[2], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            decay = g[b, h].double().exp()
            S = states[b, h] * (decay[:, None] if per_channel else decay)
            delta = (v[b, h].double() - S.T @ k[b, h]) * beta[b, h].double()
            states[b, h] = S + torch.outer(k[b, h], delta)
            out[b, h] = states[b, h].T @ q[b, h] * scale
    return out


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_steps(isa, batch, per_channel):
    torch.manual_seed(batch)
    H, Dk, Dv = 6, 13, 37
    Hk = H if per_channel else 3  # NOTE: KDA has no grouped heads
    slots = SLOTS[batch]
    index = torch.tensor(slots)
    cache = torch.randn(ROWS, H, Dk, Dv)
    q, k, v = torch.randn(batch, Hk, Dk), torch.randn(batch, Hk, Dk), torch.randn(batch, H, Dv)
    g = -torch.rand(batch, H, Dk) if per_channel else -torch.rand(batch, H)
    beta = torch.rand(batch, H)
    step = recurrent.recurrent_kda_step if per_channel else recurrent.recurrent_gated_delta_step
    fused = state_steps.kda_step if per_channel else state_steps.gated_delta_step
    torch_states, ref64 = cache[index].clone(), cache[index].double()
    expect = step(q, k, v, g, beta, torch_states, 0.3)
    exact = delta_reference(q, k, v, g, beta, ref64, 0.3, per_channel)
    native_cache = cache.clone()
    out = fused(native_cache, index, q, k, v, g, beta, 0.3)
    assert out is not None and out.dtype == v.dtype
    close(out, expect)
    close(native_cache[index], torch_states)
    close(out, exact, 2e-6)
    close(native_cache[index], ref64, 2e-6)
    untouched(cache, native_cache, slots)


def ssd_reference(x, dt, A, B, C, D, states):
    H = x.shape[1]
    x, dt = x.double(), dt.double()
    Bh = B.double().repeat_interleave(H // B.shape[1], dim=1)
    Ch = C.double().repeat_interleave(H // C.shape[1], dim=1)
    decay = (dt * A.double()).exp()[..., None, None]
    states.copy_(states * decay + x[..., :, None] * (dt[..., None] * Bh)[:, :, None, :])
    return (states @ Ch[..., None])[..., 0] + x * D.double()[:, None]


@pytest.mark.parametrize("batch", [1, 5])
def test_ssd_step(isa, batch):
    torch.manual_seed(batch)
    H, P, N, G = 6, 11, 19, 3
    slots = SLOTS[batch]
    index = torch.tensor(slots)
    cache = torch.randn(ROWS, H, P, N)
    x, dt = torch.randn(batch, H, P), torch.rand(batch, H)
    A, D = -torch.rand(H), torch.randn(H)
    B, C = torch.randn(batch, G, N), torch.randn(batch, G, N)
    torch_states, ref64 = cache[index].clone(), cache[index].double()
    expect = recurrent.ssd_step(x, dt, A, B, C, D, torch_states)
    exact = ssd_reference(x, dt, A, B, C, D, ref64)
    native_cache = cache.clone()
    out = state_steps.ssd_step(native_cache, index, x, dt, A, B, C, D)
    assert out is not None
    close(out, expect)
    close(native_cache[index], torch_states)
    close(out, exact, 2e-6)
    close(native_cache[index], ref64, 2e-6)
    untouched(cache, native_cache, slots)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_step(isa, batch, bias, activation):
    torch.manual_seed(batch)
    C, K = 29, 4
    slots = SLOTS[batch]
    index = torch.tensor(slots)
    cache = torch.randn(ROWS, C, K - 1)
    x = torch.randn(batch, 2 * C)[:, :C]  # NOTE: rows strided, as a split projection's
    w, b = torch.randn(C, K), torch.randn(C) if bias else None
    torch_states = cache[index].clone()
    expect = recurrent.causal_conv1d_step(x, w, b, torch_states, activation)
    full = torch.cat([cache[index].double(), x.double()[:, :, None]], dim=2)
    exact = (full * w.double()).sum(-1) + (b.double() if bias else 0)
    exact = F.silu(exact) if activation else exact
    native_cache = cache.clone()
    out = state_steps.conv_step(native_cache, index, x, w, b, activation)
    assert out is not None
    close(out, expect)
    close(out, exact, 2e-6)
    assert torch.equal(native_cache[index], torch_states)  # NOTE: the window moves, exactly
    untouched(cache, native_cache, slots)


def test_conv_step_bf16(isa):
    """bf16 windows move exactly; outputs round once to bf16 as torch's conv1d, then SiLU."""
    torch.manual_seed(0)
    C, K = 64, 4
    index = torch.tensor(SLOTS[5])
    cache = torch.randn(ROWS, C, K - 1).bfloat16()
    x, w = torch.randn(5, C).bfloat16(), torch.randn(C, K).bfloat16()
    torch_states = cache[index].clone()
    expect = recurrent.causal_conv1d_step(x, w, None, torch_states, "silu")
    native_cache = cache.clone()
    out = state_steps.conv_step(native_cache, index, x, w, None, "silu")
    assert out.dtype == torch.bfloat16 and torch.equal(native_cache[index], torch_states)
    close(out.float(), expect.float(), 1e-2)  # NOTE: a bf16 ulp where sums round differently


def test_declined():
    """What the kernels do not take goes back to the torch step (None)."""
    cache, index = torch.randn(ROWS, 2, 4, 4), torch.tensor([1])
    q, v, g, beta = torch.randn(1, 2, 4), torch.randn(1, 2, 4), -torch.rand(1, 2), torch.rand(1, 2)
    args = (index, q, q, v, g, beta, 1.0)
    assert state_steps.gated_delta_step(cache.double(), *args) is None
    assert state_steps.gated_delta_step(cache.transpose(2, 3), *args) is None
    conv = torch.randn(ROWS, 8, 3)
    x, w = torch.randn(1, 8), torch.randn(8, 4)
    assert state_steps.conv_step(conv, index, x, w, None, "gelu") is None
    assert state_steps.conv_step(conv.bfloat16(), index, x, w, None, "silu") is None


@pytest.mark.parametrize("enabled", [True, False], ids=["native", "torch"])
def test_ops_decode_rows(enabled, monkeypatch):
    """``state_ops``' decode rows give the same outputs and states on either path, and the
    native path runs no torch step."""
    conv_step, delta_step = recurrent.causal_conv1d_step, recurrent.recurrent_gated_delta_step
    ran = []
    monkeypatch.setattr(state_steps, "ENABLED", enabled)
    monkeypatch.setattr(recurrent, "causal_conv1d_step", lambda *a: ran.append(1) or conv_step(*a))
    monkeypatch.setattr(
        recurrent, "recurrent_gated_delta_step", lambda *a: ran.append(1) or delta_step(*a)
    )
    torch.manual_seed(1)
    H, Dk, Dv, C = 4, 8, 5, 12
    slots = SLOTS[5]
    states = {"conv": torch.randn(ROWS, C, 3), "recurrent": torch.randn(ROWS, H, Dk, Dv)}
    meta = SimpleNamespace(
        num_decode_tokens=5,
        decode_state_slots=torch.tensor(slots),
        prefills=[],
        state_slots=slots,
        state_saves=None,
    )
    ctx = SimpleNamespace(meta=meta, states=[{n: t.clone() for n, t in states.items()}])
    x, w = torch.randn(5, C), torch.randn(C, 4)
    q, k, v = torch.randn(5, H, Dk), torch.randn(5, H, Dk), torch.randn(5, H, Dv)
    g, beta = -torch.rand(5, H), torch.rand(5, H)
    y = state_ops.conv(ctx, 0, x, w, None, "silu")
    o = state_ops.gated_delta(ctx, 0, q, k, v, g, beta, 0.5)
    assert len(ran) == (0 if enabled else 2)
    conv_states, rec_states = states["conv"][slots].clone(), states["recurrent"][slots].clone()
    close(y, conv_step(x, w, None, conv_states, "silu"))
    close(o, delta_step(q, k, v, g, beta, rec_states, 0.5))
    close(ctx.states[0]["conv"][slots], conv_states)
    close(ctx.states[0]["recurrent"][slots], rec_states)
