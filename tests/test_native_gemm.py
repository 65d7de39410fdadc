"""The native bf16 GEMM (``kernels/native/csrc/gemm.cpp``) against a float64 reference, in
every instruction set this CPU can run, and wired into the compiled step's packed linears."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import lent_a_helper, until_a_helper_shares
from warmboot.kernels import native
from warmboot.kernels.step_ops import native_gemm, onednn_bf16, pack_weight, packed_gemm

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _reference(x, w, b) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 output: one rounding, 2^-8 relative at most; fp32 sums add far less at these sizes
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-4).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 2),
        (1, 33, 576),
        (3, 95, 130),
        (8, 960, 576),
        (9, 64, 1536),
        (33, 70, 64),
        (64, 40, 96),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(isa, m, n, k, bias):
    x, w, b = _case(m, n, k, bias)
    y = torch.ops.warmboot_cpu.linear(x, torch.ops.warmboot_cpu.pack_linear(w), b, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, _reference(x, w, b))


@pytest.mark.parametrize("n, k", [(1, 2), (31, 130), (32, 128), (70, 1538), (97, 64)])
def test_the_packed_layout_exactly(n, k):
    """Panels of 32 output rows, k pairs side by side, rows past n zero; a strided weight
    (a transposed view) packs as its contiguous copy."""
    w = torch.randn(n, k).to(torch.bfloat16)
    panels = -(-n // 32)
    padded = torch.zeros(panels * 32, k, dtype=torch.bfloat16)
    padded[:n] = w
    want = padded.view(panels, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(torch.ops.warmboot_cpu.pack_linear(w), want)
    assert torch.equal(torch.ops.warmboot_cpu.pack_linear(w.t().contiguous().t()), want)


def test_float32_rows_and_leading_dims(isa):
    x, w, b = _case(6, 50, 80, True)
    packed = torch.ops.warmboot_cpu.pack_linear(w)
    y = torch.ops.warmboot_cpu.linear(x.float().view(2, 3, 80), packed, b, 50)
    assert y.shape == (2, 3, 50) and y.dtype == torch.float32
    ref = _reference(x, w, b).view(2, 3, 50)
    assert (y.double() - ref).abs().max() < 1e-3  # NOTE: bf16 paths round the rows to bf16


def test_zero_rows_and_threads():
    x, w, _ = _case(0, 40, 64, False)
    packed = torch.ops.warmboot_cpu.pack_linear(w)
    assert torch.ops.warmboot_cpu.linear(x, packed, None, 40).shape == (0, 40)
    x, w, b = _case(5, 1000, 256, True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = torch.ops.warmboot_cpu.linear(x, torch.ops.warmboot_cpu.pack_linear(w), b, 1000)
    finally:
        torch.set_num_threads(threads)
    _check(y, _reference(x, w, b))


def test_bad_input_is_refused():
    x, w, _ = _case(2, 40, 64, False)
    packed = torch.ops.warmboot_cpu.pack_linear(w)
    with pytest.raises(RuntimeError, match="even in_features"):
        torch.ops.warmboot_cpu.pack_linear(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        torch.ops.warmboot_cpu.pack_linear(w.float())
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.warmboot_cpu.linear(x[:, :32], packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.warmboot_cpu.linear(x, packed, None, 80)
    with pytest.raises(RuntimeError, match="pack_linear"):
        torch.ops.warmboot_cpu.linear(x, w, None, 40)
    with pytest.raises(RuntimeError, match="cannot run|unknown"):
        torch.ops.warmboot_cpu.use_isa("amx")


@pytest.mark.skipif(not native.amx(), reason="no AMX on this CPU, or the OS withholds it")
@pytest.mark.parametrize(
    "m,n,k",
    [(4, 33, 64), (5, 95, 576), (16, 960, 576), (17, 64, 1536), (33, 70, 96), (64, 40, 128)],
)
def test_amx_tiles_match_float64_and_the_dot_products(m, n, k):
    x, w, b = _case(m, n, k, True)
    packed = pack_weight(w)
    try:
        tiles = packed_gemm(x, packed, b, n)
        torch.ops.warmboot_cpu.use_amx(False)
        dots = packed_gemm(x, packed, b, n)
    finally:
        torch.ops.warmboot_cpu.use_amx(True)
    _check(tiles, _reference(x, w, b))
    _check(dots, _reference(x, w, b))
    assert (tiles.float() - dots.float()).abs().max() <= tiles.float().abs().max() * 2**-7


def test_amx_is_refused_where_the_cpu_or_os_has_none():
    if native.amx():
        pytest.skip("this CPU and OS run AMX")
    with pytest.raises(RuntimeError, match="cannot run AMX"):
        torch.ops.warmboot_cpu.use_amx(True)


def test_packed_linears_take_native_panels_for_bf16_only():
    x, w, b = _case(4, 48, 64, True)
    packed = pack_weight(w)
    assert native_gemm(w) and packed.dim() == 4
    _check(packed_gemm(x, packed, b, 48), _reference(x, w, b))
    assert pack_weight(w.float()).dim() == 2  # fp32 stays on oneDNN
    if onednn_bf16():
        assert pack_weight(w, "onednn").dim() == 2
    else:  # NOTE: an AVX2-only CPU: refused by name, not a oneDNN error mid-compile
        with pytest.raises(RuntimeError, match="cannot pack a bf16"):
            pack_weight(w, "onednn")
    assert not native_gemm(torch.zeros(4, 7, dtype=torch.bfloat16))  # odd in_features


def test_from_dense_rows_on_a_packed_linear_is_the_model_weights_f_linear():
    from torch import nn

    from warmboot.kernels.step_ops import PackedLinears, StepContext, bound, packed_linear

    _, w, b = _case(1, 48, 64, True)
    lin = nn.Linear(64, 48, dtype=torch.bfloat16)
    lin.weight.data, lin.bias.data = w, b
    table = PackedLinears()
    table.add_layer([lin])
    table.set_dense_rows(4)
    x = _case(6, 48, 64, False, seed=1)[0]
    with bound(StepContext(None, [], None, [], table)), torch.inference_mode():
        zero = torch.tensor(0)
        few, many = packed_linear(x[:3], zero, 0, 48), packed_linear(x, zero, 0, 48)
        assert torch.equal(few, packed_gemm(x[:3], table.layers[0][0][0], b, 48))
        assert torch.equal(many, torch.nn.functional.linear(x, w, b))
        table.set_dense_rows(None)
        assert torch.equal(
            packed_linear(x, zero, 0, 48), packed_gemm(x, table.layers[0][0][0], b, 48)
        )
    _check(many, _reference(x, w, b))


def _tasks() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


STRESS = """
import torch
torch.set_num_threads(1)  # NOTE: the helpers serve only a caller on one torch thread
from warmboot.kernels import native
from warmboot.kernels.step_ops import pack_weight, packed_gemm
g = torch.Generator().manual_seed(0)
calls = []
for n in (1024, 4096, 1536):  # 2, 8 and 3 chunks of 16 panels at k=64
    w = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    calls.append((torch.randn(1, 64, generator=g).to(torch.bfloat16), pack_weight(w, "native"), n))
alone = [packed_gemm(x, p, None, n) for x, p, n in calls]
native.use_helpers(1, [])
for i in range(20000):
    x, p, n = calls[i % 3]
    assert torch.equal(packed_gemm(x, p, None, n), alone[i % 3]), i
assert native.helper_chunks() > 0, "the helper took no chunk"
native.use_helpers(0, [])
print("ok")
"""


def test_helper_threads_survive_back_to_back_calls_of_changing_size():
    """Tiny calls back to back, their chunk counts alternating, in two processes at once (four
    threads on the cores, so threads are preempted mid-protocol): the claim protocol's
    stress test. A decode benchmark once hung in the caller's wait (a stale claim could count
    into the next call); the ticket is now closed while a call is set up. Child processes, so
    a hang fails the test instead of hanging the suite."""
    import subprocess
    import sys

    children = [
        subprocess.Popen([sys.executable, "-c", STRESS], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outs = [c.communicate(timeout=120)[0] for c in children]
    finally:
        for c in children:
            c.kill()
    assert [c.returncode for c in children] == [0, 0] and all(o.strip() == "ok" for o in outs)


def test_helper_threads_change_no_bit_and_stop():
    """``csrc/pool.cpp``: chunks taken by a helper thread give the same bits as the caller
    alone, at every chunking; stopping the helpers ends their threads."""
    cases = [_case(m, n, 576, bias=m % 2 == 1, seed=m) for m, n in [(1, 960), (5, 49), (33, 3072)]]
    packed = [(x, pack_weight(w, "native"), b, w.shape[0]) for x, w, b in cases]
    alone = [packed_gemm(x, p, b, n) for x, p, b, n in packed]
    before, threads = _tasks(), torch.get_num_threads()
    assert native.use_helpers(1, []) == 1
    torch.set_num_threads(1)  # NOTE: the helpers serve only a caller on one torch thread
    try:
        assert _tasks() == before + 1

        def round_() -> None:  # NOTE: races show up as wrong bits in some rounds
            lent = [packed_gemm(x, p, b, n) for x, p, b, n in packed]
            assert all(torch.equal(a, h) for a, h in zip(alone, lent, strict=True))

        until_a_helper_shares(round_, rounds=50)
    finally:
        torch.set_num_threads(threads)
        assert native.use_helpers(0, []) == 0
    assert _tasks() == before


def test_dense_linear_shares_row_blocks_with_the_helper_and_keeps_its_bits():
    """``csrc/dense.cpp`` (prefill-sized GEMMs on torch's own kernel): row blocks give the
    same bits lent a helper thread or not, in inference mode too (the helper takes the
    caller's mode); within bf16 error of float64; below two blocks it is ``F.linear``."""
    x, w, b = _case(1000, 200, 192, bias=True)
    x3 = x.view(10, 100, 192)
    alone = torch.ops.warmboot_cpu.dense_linear(x3, w, b)

    def round_() -> None:  # NOTE: in inference mode (lent_a_helper's)
        assert torch.equal(torch.ops.warmboot_cpu.dense_linear(x3, w, b), alone)

    lent_a_helper(round_)
    assert alone.shape == (10, 100, 200)
    _check(alone.view(1000, 200), _reference(x, w, b))
    few = x[:511]
    assert torch.equal(
        torch.ops.warmboot_cpu.dense_linear(few, w, None), torch.nn.functional.linear(few, w)
    )
