"""LoRA's native decode op (``kernels/native/csrc/lora.cpp``, taken by ``lora_add`` on the CPU)
in every instruction set this CPU runs, against a float64 reference from the very values the
stack holds: a mixed batch (decodes of several slots and the base, prefill segments), a
packed linear whose adapters fill some shards at different ranks, sizes that leave every
vector loop a tail.

Bound: float32 sums (bf16 products are exact in float32), then one rounding to the output's
dtype: bf16 half an ulp, 2^-8 of the value; float32 a few ulps of the terms' sizes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import lent_a_helper
from warmboot.kernels import lora, native
from warmboot.kernels.lora import LoraStack, lora_add, lora_rows

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

IN = 72  # 2 x 32 + 8: a tail for the 8-, 16- and 32-lane loops
SHARDS = [150, 40, 24]  # 150 = 128 + 16 + 6: the expand's block, a whole vector and a tail
MAX_RANK = 8
SLOTS = 4
RANKS = {0: (6, 3, None), 1: (None, 8, 1), 2: (5, 5, 5), 3: (8, None, 2)}
"""Per adapter slot, the rank of each shard (None: not targeted)."""
ROW_SLOTS = [0, None, 2, 1, 3, 0, 2, -1, 1, 2, None, 3]
ROW_TOKENS = [1] * 9 + [4, 3, 2]  # 9 decodes (one of the base), then prefills
DECODES = 9
BOUND = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2.0**-8, 1e-5)}
"""(relative, absolute) error of a decode row."""
PREFILL_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}
"""torch's GEMMs, which round the shrink's output to bf16 (as tests/test_lora_kernel.py)."""
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def make_stack(dtype, ranks=RANKS, seed: int = 0) -> LoraStack:
    stack = LoraStack(SLOTS, MAX_RANK, IN, SHARDS, dtype)
    g = torch.Generator().manual_seed(seed)
    for slot, rs in ranks.items():
        parts = [
            None
            if r is None
            else (torch.randn(r, IN, generator=g) / IN**0.5, torch.randn(out, r, generator=g))
            for out, r in zip(SHARDS, rs, strict=True)
        ]
        stack.load(slot, parts)
    return stack


def inputs(dtype, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g).to(dtype)
    return x, torch.randn(rows, sum(SHARDS), generator=g).to(dtype)


def reference(y, x, stack: LoraStack, token_slots: list[int | None]) -> torch.Tensor:
    """Per token of an adapter slot: y_t + (x_t @ A_s.T) @ B_s.T over the whole stack, in
    float64 from the values the stack holds (its zero rows and blocks included)."""
    out = y.double().clone()
    a, b = stack.a.double(), stack.b.double()
    for t, s in enumerate(token_slots):
        if s is not None and 0 <= s < SLOTS:
            out[t] += b[s] @ (a[s] @ x[t].double())
    return out


def plan(row_slots=ROW_SLOTS, row_tokens=ROW_TOKENS):
    return lora_rows(row_slots, row_tokens, SLOTS, lambda t: t)


def token_slots(row_slots=ROW_SLOTS, row_tokens=ROW_TOKENS) -> list:
    return [s for s, n in zip(row_slots, row_tokens, strict=True) for _ in range(n)]


def check_decodes(out, ref, dtype, rows: int) -> None:
    rel, tiny = BOUND[dtype]
    err = (out[:rows].double() - ref[:rows]).abs()
    bound = ref[:rows].abs() * rel + tiny
    assert (err <= bound).all(), f"max error {err.max():.3g}, over the bound {(err / bound).max()}"


def no_torch_decode(*args):
    raise AssertionError("the torch decode ran: the native op should have")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mixed_batch(isa, dtype, monkeypatch):
    """Decodes of four slots and the base (native), prefill segments (torch's GEMMs)."""
    monkeypatch.setattr(lora, "_decode", no_torch_decode)
    stack = make_stack(dtype)
    x, y = inputs(dtype, sum(ROW_TOKENS))
    out = lora_add(y, x, stack, plan())
    ref = reference(y, x, stack, token_slots())
    assert out.dtype == dtype and out.shape == y.shape
    check_decodes(out, ref, dtype, DECODES)
    assert torch.equal(out[1], y[1]) and torch.equal(out[7], y[7])  # NOTE: the base's rows
    atol, rtol = PREFILL_TOL[dtype]
    torch.testing.assert_close(out[DECODES:].double(), ref[DECODES:], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_only_with_padding_and_a_strided_x(isa, dtype):
    """Rows past the plan's (padding) come back as y's; x a column slice of a wider tensor."""
    stack = make_stack(dtype)
    x, y = inputs(dtype, 12, seed=3)
    wide = torch.zeros(12, IN + 5, dtype=dtype)
    wide[:, 2 : 2 + IN] = x
    slots = [3, 2, None, 0, 0, 1, 2]
    out = lora_add(y, wide[:, 2 : 2 + IN], stack, plan(slots, [1] * 7))
    check_decodes(out, reference(y, x, stack, slots), dtype, 7)
    assert torch.equal(out[7:], y[7:]) and torch.equal(out[2], y[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stack_written_in_place_reads_every_rank_row(isa, dtype):
    """A stack filled in place (as the benchmark does) keeps ``max_rank`` rows a shard in
    ``ranks``: the op reads them all; a cleared slot adds nothing."""
    stack = LoraStack(SLOTS, MAX_RANK, IN, SHARDS, dtype)
    stack.a[:SLOTS].normal_(0, IN**-0.5)
    for bt in stack.bs:
        bt[:SLOTS].normal_()
    stack.clear(2)
    x, y = inputs(dtype, 6, seed=4)
    slots = [0, 1, 2, 3, None, 1]
    out = lora_add(y, x, stack, plan(slots, [1] * 6))
    check_decodes(out, reference(y, x, stack, slots), dtype, 6)
    assert torch.equal(out[2], y[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_of_one_slot_together_give_each_rows_bits(isa, dtype):
    """Rows of a slot go through in groups (up to 4, each A and B vector loaded once): runs
    of 1 to 4 rows and one longer than a group, each row's bits those of the row alone."""
    stack = make_stack(dtype)
    slots = [2] * 7 + [1, 3, 1, 0, 3, 0, 3, None, 0]
    x, y = inputs(dtype, len(slots), seed=6)
    out = lora_add(y, x, stack, plan(slots, [1] * len(slots)))
    check_decodes(out, reference(y, x, stack, slots), dtype, len(slots))
    for t, s in enumerate(slots):
        alone = lora_add(y[t : t + 1], x[t : t + 1], stack, plan([s], [1]))
        assert torch.equal(out[t], alone[0]), f"row {t}"


def test_rank_rows_past_an_adapter_are_not_read():
    """``ranks`` bounds what the op reads: rows past an adapter's rank changed behind the
    stack's back change nothing (torch's form reads them: the difference shows it)."""
    stack = make_stack(torch.float32)
    x, y = inputs(torch.float32, 4)
    rows = plan([0, 1, 2, 3], [1] * 4)
    before = lora_add(y, x, stack, rows)
    stack.a[0, 6:8] = 1.0  # NOTE: shard 0 of slot 0 has rank 6
    stack.bs[0][0, 6:8] = 1.0
    assert torch.equal(lora_add(y, x, stack, rows), before)


def test_helper_threads_give_the_same_bits():
    """Rows shared with a helper thread: each row is one thread's, so the bits are one
    thread's."""
    stack = make_stack(torch.bfloat16)
    x, y = inputs(torch.bfloat16, 64, seed=5)
    rows = plan([i % 5 for i in range(64)], [1] * 64)
    want = lora_add(y, x, stack, rows)

    def round_():
        assert torch.equal(lora_add(y, x, stack, rows), want)

    lent_a_helper(round_)


def test_refuses_what_does_not_fit():
    stack = make_stack(torch.float32)
    x, y = inputs(torch.float32, 3)
    op = torch.ops.warmboot_cpu.lora_decode
    with pytest.raises(RuntimeError, match="slot 5 of row 1"):
        op(y, x, stack.a, stack.bs, stack.ranks, torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="D <= 3"):
        op(y, x, stack.a, stack.bs, stack.ranks, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="ranks must be"):
        op(y, x, stack.a, stack.bs, stack.ranks.long(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="share y's dtype"):
        op(y, x.bfloat16(), stack.a, stack.bs, stack.ranks, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="shards are 214 wide, y 190"):
        op(y[:, :190], x, stack.a, stack.bs, stack.ranks, torch.tensor([0]))
    stack.ranks[1, 0] = MAX_RANK + 1
    with pytest.raises(RuntimeError, match="rank 9 of slot 1"):
        op(y, x, stack.a, stack.bs, stack.ranks, torch.tensor([1]))


def test_fp16_and_no_library_take_torch(monkeypatch):
    """fp16 rows, and a process without the library, keep torch's form."""
    stack = make_stack(torch.float16)
    x, y = inputs(torch.float16, 3)
    assert not lora.uses_native(y, x, stack)
    monkeypatch.setattr(lora, "NATIVE", False)
    stack32 = make_stack(torch.float32)
    x32, y32 = inputs(torch.float32, 3)
    assert not lora.uses_native(y32, x32, stack32)
    monkeypatch.setattr(lora, "NATIVE", True)
    monkeypatch.setattr(lora, "_NATIVE_OP", {})
    monkeypatch.setattr(native, "ready", lambda: False)
    assert not lora.uses_native(y32, x32, stack32)
