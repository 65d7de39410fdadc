"""The state layers' Triton decode steps (interpreter) against the torch steps of
``kernels.recurrent``: float32, slots in no particular order, batch 1 and 3, head dims 16
and 24 (masked blocks), several blocks per head, grouped heads; each slot's state row
updated in place and every other row untouched (bit for bit)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (jit decorations)

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from warmboot.kernels import recurrent, triton_state  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter
SLOTS = {1: [2], 3: [4, 0, 3]}
NUM_SLOTS = 6
CASES = [(1, 16), (1, 24), (3, 16), (3, 24)]  # (batch, head dim)


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _block(batch: int) -> int | None:
    """The default block at batch 1; 16 at batch 3 (two blocks for dim 24, the last masked)."""
    return None if batch == 1 else 16


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _run(step, kernel, cache: torch.Tensor, batch: int, *rows, tol: float = 1e-5):
    """``kernel(cache, slots, *rows)`` against ``step(*rows, states)`` on a copy of the
    gathered rows: outputs, the slots' rows and the untouched others."""
    slots = SLOTS[batch]
    index = torch.tensor(slots)
    states = cache[index]
    want = step(*rows, states)
    before = cache.clone()
    got = kernel(cache, index, *rows)
    _close(got, want, tol)
    _close(cache[index], states)
    others = [r for r in range(NUM_SLOTS) if r not in slots]
    assert torch.equal(cache[others], before[others])
    assert not torch.equal(cache[index], before[index])


def _delta_inputs(batch, dim, heads, kheads, per_channel, dtype=torch.float32):
    g = _gen(batch, dim, heads, kheads, per_channel)
    qk = torch.randn(batch, 2 * kheads, dim, generator=g)
    q, k = (t.to(dtype) for t in qk.split(kheads, dim=1))  # not contiguous in float32
    v = torch.randn(batch, heads, dim, generator=g).to(dtype)
    decay_shape = (batch, heads, dim) if per_channel else (batch, heads)
    log_decay = (-torch.rand(decay_shape, generator=g)).to(dtype)
    beta = torch.rand(batch, heads, generator=g).sigmoid().to(dtype)
    cache = torch.randn(NUM_SLOTS, heads, dim, dim, generator=g)
    return cache, (q, k, v, log_decay, beta)


@pytest.mark.parametrize("batch,dim", CASES)
def test_gated_delta(batch, dim):
    cache, rows = _delta_inputs(batch, dim, 4, 2, False)  # grouped: 2 q/k heads, 4 v heads
    scale = dim**-0.5

    def kernel(cache, slots, *rows):
        return triton_state.gated_delta_decode(cache, slots, *rows, scale, block_v=_block(batch))

    step = recurrent.recurrent_gated_delta_step
    _run(lambda *a: step(*a, scale), kernel, cache, batch, *rows)


@pytest.mark.parametrize("batch,dim", CASES)
def test_kda(batch, dim):
    cache, rows = _delta_inputs(batch, dim, 2, 2, True)
    scale = dim**-0.5

    def kernel(cache, slots, *rows):
        return triton_state.kda_decode(cache, slots, *rows, scale, block_v=_block(batch))

    _run(lambda *a: recurrent.recurrent_kda_step(*a, scale), kernel, cache, batch, *rows)


def test_gated_delta_bf16():
    """bf16 inputs: the same float32 maths, the output rounded to bf16."""
    cache, rows = _delta_inputs(3, 24, 2, 2, False, torch.bfloat16)

    def kernel(cache, slots, *rows):
        return triton_state.gated_delta_decode(cache, slots, *rows, 0.2)

    step = recurrent.recurrent_gated_delta_step
    _run(lambda *a: step(*a, 0.2), kernel, cache, 3, *rows, tol=1e-2)


@pytest.mark.parametrize("batch,dim", CASES)
def test_ssd(batch, dim):
    heads, groups = 4, 2
    g = _gen(batch, dim, "ssd")
    x = torch.randn(batch, heads, dim, generator=g)
    dt = torch.rand(batch, heads, generator=g)
    A = -torch.rand(heads, generator=g) - 0.5
    B, C = torch.randn(batch, 2 * groups, dim + 2, generator=g).split(groups, dim=1)
    D = torch.randn(heads, generator=g)
    cache = torch.randn(NUM_SLOTS, heads, dim, dim + 2, generator=g)  # P = dim, N = dim + 2

    def kernel(cache, slots, *rows):
        return triton_state.ssd_decode(cache, slots, *rows, block_p=_block(batch))

    _run(recurrent.ssd_step, kernel, cache, batch, x, dt, A, B, C, D)


@pytest.mark.parametrize("batch,dim", CASES)
@pytest.mark.parametrize("width", [4, 2])
def test_conv(batch, dim, width):
    silu = batch == 3
    g = _gen(batch, dim, width, "conv")
    x = torch.randn(batch, dim, generator=g)
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g) if dim == 24 else None
    cache = torch.randn(NUM_SLOTS, dim, width - 1, generator=g)
    act = "silu" if silu else None

    def kernel(cache, slots, x):
        return triton_state.conv_decode(cache, slots, x, weight, bias, act, block_c=_block(batch))

    step = recurrent.causal_conv1d_step
    _run(lambda x, states: step(x, weight, bias, states, act), kernel, cache, batch, x)


def test_conv_bf16():
    """A bf16 window and weight: accumulated in float32, the output rounded to bf16."""
    g = _gen("conv_bf16")
    x = torch.randn(3, 24, generator=g).bfloat16()
    weight, bias = torch.randn(24, 4, generator=g).bfloat16(), torch.randn(24).bfloat16()
    cache = torch.randn(NUM_SLOTS, 24, 3, generator=g).bfloat16()

    def kernel(cache, slots, x):
        return triton_state.conv_decode(cache, slots, x, weight, bias, "silu")

    step = recurrent.causal_conv1d_step
    _run(lambda x, states: step(x, weight, bias, states, "silu"), kernel, cache, 3, x, tol=2e-2)


def test_refusals():
    cache, (q, k, v, log_decay, beta) = _delta_inputs(1, 16, 4, 2, False)
    slots = torch.tensor([1])
    with pytest.raises(ValueError, match="v must be"):
        triton_state.gated_delta_decode(cache, slots, q, k, v[:, :3], log_decay, beta, 1.0)
    with pytest.raises(ValueError, match="q's 2 heads must be"):
        triton_state.kda_decode(cache, slots, q, k, v, log_decay, beta, 1.0)
    with pytest.raises(ValueError, match="state cache must be"):
        triton_state.gated_delta_decode(cache.double(), slots, q, k, v, log_decay, beta, 1.0)
    with pytest.raises(ValueError, match="slots must be"):
        triton_state.gated_delta_decode(cache, slots.float(), q, k, v, log_decay, beta, 1.0)
    with pytest.raises(ValueError, match="B's 3 groups"):
        x, dt, A = torch.zeros(1, 4, 16), torch.zeros(1, 4), torch.zeros(4)
        B = torch.zeros(1, 3, 16)
        triton_state.ssd_decode(cache, slots, x, dt, A, B, B, A)
    conv_cache = torch.zeros(NUM_SLOTS, 8, 3)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        triton_state.conv_decode(conv_cache, slots, torch.zeros(1, 8), conv_cache[0], None, "gelu")
    with pytest.raises(ValueError, match="weight must be"):
        triton_state.conv_decode(conv_cache, slots, torch.zeros(1, 8), conv_cache[0], None, None)


def test_the_decode_rows_reach_these_kernels_on_cuda(monkeypatch):
    """``kernels.state_steps`` (what ``state_ops``' decode rows call) hands a CUDA state cache
    to these kernels, arguments in order, and declines what their checks refuse (the torch
    step then runs): the interpreter on CPU tensors stands in for CUDA."""
    from warmboot.kernels import state_steps as fused

    monkeypatch.setattr(fused, "_on_cuda", lambda states: True)
    monkeypatch.setattr(fused.native, "ready", lambda: False)  # NOTE: no CPU kernel answers
    cache, rows = _delta_inputs(3, 16, 4, 2, False)
    step, kernel = recurrent.recurrent_gated_delta_step, fused.gated_delta_step
    _run(_scale_last(step), _scale_last(kernel), cache, 3, *rows)
    cache, rows = _delta_inputs(3, 16, 2, 2, True)
    _run(_scale_last(recurrent.recurrent_kda_step), _scale_last(fused.kda_step), cache, 3, *rows)
    x, weight, states = torch.randn(3, 8), torch.randn(8, 4), torch.randn(NUM_SLOTS, 8, 3)

    def conv(x, st):
        return recurrent.causal_conv1d_step(x, weight, None, st, "silu")

    _run(conv, lambda c, s, x: fused.conv_step(c, s, x, weight, None, "silu"), states, 3, x)
    assert fused.conv_step(states, torch.tensor([1]), x[:1], weight, None, "gelu") is None


def _scale_last(fn):
    """``fn`` with the delta rules' output scale (their last argument) fixed."""
    return lambda *args: fn(*args, 0.3)
