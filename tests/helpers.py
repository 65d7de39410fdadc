"""Shared test helpers: the transformers reference and prompt generation."""

from __future__ import annotations

import torch


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


def stop_window(text: str, start: int, size: int) -> tuple[int, str]:
    """The first ``size``-char printable ASCII window at or after ``start`` whose first
    occurrence in ``text`` is where it was found (a stop string that really hits there)."""
    for i in range(start, len(text) - size):
        s = text[i : i + size]
        if all(c.isascii() and c.isprintable() for c in s) and text.find(s) == i:
            return i, s
    raise AssertionError(f"precondition: no {size}-char ASCII window in {text!r}")
