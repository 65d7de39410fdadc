"""Greedy sampling's native argmax (``kernels/native/csrc/argmax.cpp``) gives torch.argmax's
answer bit for bit: first maximum on ties, first NaN, all -inf, odd vocabularies, both
instruction paths (AVX-512 and scalar) and both dtypes; the sampler's greedy rows use it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import until_a_helper_shares
from warmboot.device.sampler import Sampler, SamplingRow
from warmboot.kernels import native
from warmboot.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


@pytest.fixture(params=["portable", "avx512"])
def isa(request):
    """The scalar loop, and the vector one where the CPU runs it."""
    best = native.isa()
    if request.param == "avx512" and best not in ("avx512", "avx512_bf16"):
        pytest.skip("this CPU cannot run avx512")
    torch.ops.warmboot_cpu.use_isa(request.param)
    yield request.param
    torch.ops.warmboot_cpu.use_isa(best)


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(rows, v, generator=g).to(dtype) for rows, v in [(1, 1), (3, 15), (2, 17)]]
    out.append(torch.randn(5, 49157, generator=g).to(dtype))
    out.append(torch.randint(0, 3, (4, 100), generator=g).to(dtype))  # ties everywhere
    out += [torch.zeros(2, 33, dtype=dtype), torch.full((2, 40), float("-inf"), dtype=dtype)]
    nans = torch.randn(3, 50, generator=g).to(dtype)
    nans[0, 7], nans[1, 49], nans[1, 48], nans[2, 3] = float("nan"), float("nan"), float("inf"), 9
    return [*out, nans, torch.randn(6, 40, generator=g).to(dtype)[:, 3:37]]  # a strided view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_is_torchs(isa, dtype):
    for x in _cases(dtype):
        got = torch.ops.warmboot_cpu.argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (x.shape, got)


def test_helpers_and_other_inputs_keep_the_answer():
    """Rows shared with a helper thread give the same; what the op does not take (3-D,
    float16) falls back to torch's argmax."""
    x = torch.randn(64, 49152)
    threads = torch.get_num_threads()
    native.use_helpers(1, [])
    torch.set_num_threads(1)
    try:

        def round_() -> None:
            assert torch.equal(native.argmax(x), x.argmax(dim=-1))

        until_a_helper_shares(round_, rounds=20)
    finally:
        torch.set_num_threads(threads)
        native.use_helpers(0, [])
    for other in (x.view(4, 16, 49152), x.half()):
        assert torch.equal(native.argmax(other), other.argmax(dim=-1))


def test_sampling_rows_take_it(monkeypatch):
    """Greedy rows (plain, and beside a penalised one) and random rows all pick by it."""
    calls = []
    monkeypatch.setattr(native, "argmax", lambda x: calls.append(x.shape) or _torchs(x))
    logits = torch.randn(3, 1000)
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], [2], None) for _ in range(3)]
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(dim=-1))
    rows[1] = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5), [1], [2], None)
    Sampler()(logits, rows)
    rows[2] = SamplingRow(SamplingParams(temperature=1.0), [1], [2], None)
    Sampler()(logits, rows)
    assert calls == [(3, 1000), (3, 1000), (3, 1000), (1, 1000)]


def _torchs(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
