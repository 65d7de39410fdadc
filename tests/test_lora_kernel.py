"""The batched LoRA op (``warmboot.kernels.lora``) against a float64 loop over tokens that
applies each token's adapter shard by shard from the adapter's own matrices: torch's forms
(dense, gathered) and, on the CPU, the native decode op (``tests/test_lora_native.py`` checks
that one closer, in every instruction set)."""

from __future__ import annotations

import pytest
import torch

from warmboot.kernels import lora, native
from warmboot.kernels.lora import LoraStack, lora_add, lora_rows

IN = 16
SHARDS = [12, 4, 4]  # a packed q/k/v
MAX_RANK = 4
SLOTS = 4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {
    torch.float32: (1e-5, 1e-5),
    # NOTE: bf16 rounds x, y, A, B, the shrink's output and the sum (8 bits of mantissa):
    # up to 4 ulps (2^-6) of the values (about 1-5 here), the largest seen 0.042 of 4.5;
    # fp16 (11 bits) about an eighth of that
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (5e-3, 4e-3),
}

# ranks per shard of the adapters in slots 1..3 (None: shard not targeted); slot 0 stays empty
RANKS = {1: (4, 2, None), 2: (None, 3, 1), 3: (1, 1, 1)}

# a step: decodes (1 token each) of several slots and the base, then prefill rows
ROW_SLOTS = [1, None, 3, 2, 1, -1, 2, None, 3, 3, 1]
ROW_TOKENS = [1, 1, 1, 1, 1, 1, 5, 3, 4, 2, 1]


def parts(ranks, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        None
        if r is None
        else (torch.randn(r, IN, generator=g) * 0.5, torch.randn(out, r, generator=g) * 0.5)
        for out, r in zip(SHARDS, ranks, strict=True)
    ]


def reference(y, x, adapters: dict, token_slots: list) -> torch.Tensor:
    """Per token, per shard: y_t[shard] += B_i @ (A_i @ x_t), in float64."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots):
        col = 0
        for n, part in zip(SHARDS, adapters.get(slot, [None] * len(SHARDS)), strict=True):
            if part is not None:
                a, b = (m.double() for m in part)
                out[t, col : col + n] += b @ (a @ x[t].double())
            col += n
    return out


def token_slots(row_slots, row_tokens) -> list:
    return [s for s, n in zip(row_slots, row_tokens, strict=True) for _ in range(n)]


def setup(dtype, device, ranks=RANKS):
    stack = LoraStack(SLOTS, MAX_RANK, IN, SHARDS, dtype, device)
    adapters = {slot: parts(r, seed=slot) for slot, r in ranks.items()}
    for slot, p in adapters.items():
        stack.load(slot, p)
    n = sum(ROW_TOKENS)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, IN, generator=g).to(dtype)
    y = torch.randn(n, sum(SHARDS), generator=g).to(dtype)
    return stack, adapters, x.to(device), y.to(device)


def plan(device, row_slots=ROW_SLOTS, row_tokens=ROW_TOKENS):
    return lora_rows(row_slots, row_tokens, SLOTS, lambda t: t.to(device))


def check(out, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=rtol)


def use_form(form: str, device, dtype, monkeypatch) -> None:
    """Decode rows by torch's ``dense`` or ``gather`` form, or the ``native`` op (skipped
    where it cannot run)."""
    if form == "native":
        if device != "cpu" or dtype == torch.float16 or native.library() is None:
            pytest.skip("the native op runs float32 and bf16 on the CPU, with the library")
        monkeypatch.setattr(lora, "_decode", None)  # NOTE: a torch decode would raise
        return
    monkeypatch.setattr(lora, "NATIVE", False)
    monkeypatch.setattr(lora, "DENSE_SPAN", lora.DENSE_SPAN if form == "dense" else 0)


FORMS = ["dense", "gather", "native"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("form", FORMS)
def test_mixed_batch(device, dtype, form, monkeypatch):
    """Decodes of three slots and the base, prefill segments of two slots and the base; a
    packed linear whose adapters target some shards, at different ranks."""
    use_form(form, device, dtype, monkeypatch)
    stack, adapters, x, y = setup(dtype, device)
    rows = plan(device)
    out = lora_add(y, x, stack, rows)
    assert out.dtype == dtype and out.shape == y.shape
    check(out, reference(y.cpu(), x.cpu(), adapters, token_slots(ROW_SLOTS, ROW_TOKENS)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
def test_decode_only_and_full_window(device, form, monkeypatch):
    """A step of decodes alone, with the builder's window and with every slot's (a plan
    that must not depend on host data)."""
    use_form(form, device, torch.float32, monkeypatch)
    stack, adapters, x, y = setup(torch.float32, device)
    slots = [3, None, 1, 3, 2]
    rows = plan(device, slots, [1] * 5)
    ref = reference(y[:5].cpu(), x[:5].cpu(), adapters, slots)
    check(lora_add(y[:5], x[:5], stack, rows), ref, torch.float32)
    rows.window = None
    check(lora_add(y[:5], x[:5], stack, rows), ref, torch.float32)


def test_single_shard_and_padding():
    """An unpacked linear; rows past the plan's (padding) are left as they were."""
    stack = LoraStack(2, 8, IN, [6], torch.float32)
    a, b = torch.randn(5, IN), torch.randn(6, 5)
    stack.load(1, [(a, b)])
    x, y = torch.randn(4, IN), torch.randn(4, 6)
    out = lora_add(y, x, stack, lora_rows([1, None, 1], [1, 1, 1], 2, lambda t: t))
    want = y.double().clone()
    want[[0, 2]] += x[[0, 2]].double() @ a.double().T @ b.double().T
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_layout():
    """Shard i's A in rank block i; B block-diagonal (``b``), shard i's output rows by rank
    block i; untargeted shards and unused rank rows zero."""
    stack, adapters, _, _ = setup(torch.float32, "cpu")
    (a0, b0), (a1, b1), _ = adapters[1]  # ranks (4, 2, None)
    want_a = torch.zeros(3 * MAX_RANK, IN)
    want_a[0:4], want_a[4:6] = a0, a1
    want_b = torch.zeros(sum(SHARDS), 3 * MAX_RANK)
    want_b[0:12, 0:4], want_b[12:16, 4:6] = b0, b1
    assert torch.equal(stack.a[1], want_a) and torch.equal(stack.b[1], want_b)
    assert not stack.a[0].any() and not stack.b[0].any() and not stack.a[SLOTS].any()
    # NOTE: ranks: slot 0 never loaded (every row may hold weights), the base none
    assert stack.ranks.tolist() == [[4, 4, 4], [4, 2, 0], [0, 3, 1], [1, 1, 1], [0, 0, 0]]


def test_reload_smaller_rank_and_clear():
    """A slot reloaded with a smaller adapter (and one shard fewer) keeps nothing of the
    first; a cleared slot adds nothing."""
    stack, _, x, y = setup(torch.float32, "cpu", {1: (4, 4, 4), 2: (None, 3, 1), 3: (1, 1, 1)})
    smaller = parts((2, None, 1), seed=11)
    stack.load(1, smaller)
    adapters = {1: smaller, 2: parts(RANKS[2], 2), 3: parts(RANKS[3], 3)}
    ref = reference(y, x, adapters, token_slots(ROW_SLOTS, ROW_TOKENS))
    check(lora_add(y, x, stack, plan("cpu")), ref, torch.float32)
    assert stack.ranks[1].tolist() == [2, 0, 1]
    stack.clear(1)
    assert stack.ranks[1].tolist() == [0, 0, 0]
    del adapters[1]
    ref = reference(y, x, adapters, token_slots(ROW_SLOTS, ROW_TOKENS))
    check(lora_add(y, x, stack, plan("cpu")), ref, torch.float32)


def test_inactive_plan_returns_y():
    stack, _, x, y = setup(torch.float32, "cpu")
    rows = lora_rows([None, -1, SLOTS], [1, 4, 2], SLOTS, lambda t: t)
    assert not rows.active
    y7 = y[:7]
    assert lora_add(y7, x[:7], stack, rows) is y7


def test_plan():
    uploads = []
    rows = lora_rows(
        [3, None, 1, 1, -1, 2, 2, None, 2], [1, 1, 1, 2, 3, 4, 1, 2, 5], 4, uploads.append
    )
    assert rows.active and len(uploads) == 1 and uploads[0].tolist() == [3, 4, 1]
    assert rows.window == (1, 4)
    # decodes: rows 0-2; then 1 (2 tokens) at 3, base (3) at 5, 2 (4 + 1, merged) at 8,
    # base (2) at 13, 2 (5) at 15
    assert rows.segments == [(3, 2, 1), (8, 5, 2), (15, 5, 2)]
    # decodes of the base alone: no decode work
    rows = lora_rows([None, None, 0], [1, 1, 3], 4, lambda t: t)
    assert rows.decode_slots is None and rows.segments == [(2, 3, 0)]


def test_load_refuses_what_does_not_fit():
    stack = LoraStack(2, 4, IN, SHARDS, torch.float32)
    with pytest.raises(ValueError, match="rank <= 4"):
        stack.load(0, parts((5, None, None), 0))
    with pytest.raises(ValueError, match="shard 1"):
        stack.load(0, [None, (torch.randn(2, IN), torch.randn(5, 2)), None])
    with pytest.raises(ValueError, match="slot 2"):
        stack.load(2, parts((1, 1, 1), 0))
    with pytest.raises(ValueError, match="2 parts"):
        stack.load(0, parts((1, 1, 1), 0)[:2])
