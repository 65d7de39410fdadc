"""Shared test helpers: the transformers reference and prompt generation."""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of one prompt with its KV cache, EOS ignored.

    NOTE: a plain argmax loop, not ``generate``: ``min_new_tokens`` would mask EOS logits.
    """
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
    return tokens


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """(len, vocab) float32 logits of transformers for every position."""
    return model(torch.tensor([token_ids])).logits[0].float()


def assert_engine_clean(llm) -> None:
    """No request left, no block leaked: every block is free or an evictable cache entry."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    # Per-request runner state (slot, generator, penalty histories) goes at the next step.
    runner = engine.runner
    runner.check_invariants()
    live = runner.request_state()
    leaving = runner.leaving() | set(engine.scheduler.finished_since_step)
    assert live <= leaving, f"runner state kept for requests that left: {live - leaving}"


def stop_window(text: str, start: int, size: int) -> tuple[int, str]:
    """The first ``size``-char printable ASCII window at or after ``start`` whose first
    occurrence in ``text`` is where it was found (a stop string that really hits there)."""
    for i in range(start, len(text) - size):
        s = text[i : i + size]
        if all(c.isascii() and c.isprintable() for c in s) and text.find(s) == i:
            return i, s
    raise AssertionError(f"precondition: no {size}-char ASCII window in {text!r}")


# NOTE: aten ops that read device data on the host (a sync, refused inside a CUDA-graph
# capture) or whose output shape depends on the data.
CAPTURE_BREAKING_OPS = frozenset(
    {
        "item",  # .item(), int(t), bool(t), float(t) (under inference_mode)
        "_local_scalar_dense",  # the same, elsewhere
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",
        "histc",
        "equal",
        "is_nonzero",
    }
)


class CaptureGuard(TorchDispatchMode):
    """Records the aten ops run inside it that would break a CUDA-graph capture."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in CAPTURE_BREAKING_OPS:
            self.hits.append(str(func))
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.hits.append(f"{func} without output_size")
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.hits.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


def guard_captured_region(monkeypatch) -> CaptureGuard:
    """Run every (emulated) decode-graph forward under one ``CaptureGuard``; ``tolist`` and
    ``numpy`` (host reads that bypass the dispatcher) count as hits there too."""
    from warmboot.device.graphs import DecodeGraphs

    guard, run, inside = CaptureGuard(), DecodeGraphs._run_eager, threading.local()

    def guarded(self, batch):
        inside.yes = True  # NOTE: per thread: the host thread works on while the forward runs
        try:
            with guard:
                return run(self, batch)
        finally:
            inside.yes = False

    def host_read(name):
        method = getattr(torch.Tensor, name)

        def read(t, *args, **kw):
            if getattr(inside, "yes", False):
                guard.hits.append(f"Tensor.{name}")
            return method(t, *args, **kw)

        return read

    monkeypatch.setattr(DecodeGraphs, "_run_eager", guarded)
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read(name))
    return guard


def until_a_helper_shares(round_, rounds: int = 10, limit_s: float = 20.0) -> None:
    """Run ``round_`` (it asserts its own answers) at least ``rounds`` times, and on until the
    native kernels' helper thread has taken a chunk (bounded by ``limit_s``): on a loaded
    machine the caller can finish every chunk of a few small calls before the helper wakes,
    so a fixed count of calls is no proof either way."""
    import time

    from warmboot.kernels import native

    chunks, deadline = native.helper_chunks(), time.monotonic() + limit_s
    done = 0
    while done < rounds or native.helper_chunks() == chunks:
        assert time.monotonic() < deadline, f"the helper took no chunk in {done} rounds"
        round_()
        done += 1


def lent_a_helper(round_) -> None:
    """``until_a_helper_shares`` with one helper thread started and one torch thread (the
    helpers serve only such a caller), in inference mode; both set back afterwards."""
    import torch

    from warmboot.kernels import native

    threads = torch.get_num_threads()
    native.use_helpers(1, [])
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            until_a_helper_shares(round_)
    finally:
        torch.set_num_threads(threads)
        native.use_helpers(0, [])


def prefill_meta(seqs, tokens: int):
    """A step's attention metadata with only the prefills ``seqs`` (``PrefillSeq``) over
    ``tokens`` rows, block size 16, the slot mapping all zeros (tests that write no K/V)."""
    import torch

    from warmboot.kernels.backend import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        prefills=seqs,
        block_size=16,
    )


NATIVE_ISAS = ["portable", "avx2", "avx512", "avx512_bf16"]
"""The native kernels' instruction sets, each running on the CPUs of those after it."""


def runnable_isas() -> list[str]:
    """The native instruction sets this CPU runs (none without the native library)."""
    from warmboot.kernels import native

    best = native.isa()
    return NATIVE_ISAS[: NATIVE_ISAS.index(best) + 1] if best else []
