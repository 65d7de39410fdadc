"""Structured outputs for the engine: one grammar matcher per constrained request, the step's
token bitmask, and advancing the matchers by committed tokens. The xgrammar side (compiling
specs, matchers, bitmask kernels) is ``grammar_backend``; it is loaded on the first
constrained request.

The loop asks for a step's bitmask only when it enqueues that step's sample, i.e. after the
previous step was committed and the matchers advanced ("forward now, sample later").
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from warmboot.core.types import ScheduledRequest, TokenEvent
from warmboot.sampling_params import StructuredOutputs

log = logging.getLogger("warmboot")


class GrammarRequests:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._args = (tokenizer_json, vocab_size, eos_token_ids)
        self._backend = None
        self._backend_lock = threading.Lock()
        """Validation threads and the engine thread may ask for the backend at once."""
        self.vocab_size = vocab_size
        self.matchers: dict[str, object] = {}

    @property
    def backend(self):
        """The xgrammar backend, created (and xgrammar imported) on first use."""
        with self._backend_lock:
            if self._backend is None:
                from warmboot.device.grammar_backend import GrammarBackend

                self._backend = GrammarBackend(*self._args)
            return self._backend

    def compile(self, spec: StructuredOutputs) -> object:
        """Compile (cached) or raise ValueError naming what is wrong with the spec."""
        return self.backend.compile(spec)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        self.matchers[req_id] = self.backend.matcher(self.backend.compile(spec))

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def bitmask(self, rows: list[ScheduledRequest]) -> torch.Tensor | None:
        """(rows, vocab/32) int32 mask of a step's sampling rows, or None if none is
        constrained. Rows without a live matcher (free or zombie rows) allow everything."""
        if not self.matchers:
            return None
        live = [(i, self.matchers.get(s.req_id)) for i, s in enumerate(rows)]
        live = [(i, m) for i, m in live if m is not None and not m.terminated]
        if not live:
            return None
        from warmboot.device.grammar_backend import allocate_bitmask

        mask = allocate_bitmask(len(rows), self.vocab_size)
        self.backend.fill_bitmasks([m for _, m in live], mask, [i for i, _ in live])
        return mask

    def accept(self, events: list[TokenEvent]) -> list[str]:
        """Advance the matchers by the committed tokens (one batched call per token position);
        return the requests whose grammar ended."""
        if not self.matchers:
            return []
        rows = []
        for ev in events:
            matcher = self.matchers.get(ev.req_id)
            if matcher is not None and not ev.finished:
                rows.append((ev.req_id, matcher, list(ev.new_token_ids)))
        rejected: dict[str, int] = {}
        for k in range(max((len(ids) for _, _, ids in rows), default=0)):
            batch = [(r, m, ids[k]) for r, m, ids in rows if len(ids) > k and r not in rejected]
            took = self.backend.accept_tokens([(m, t) for _, m, t in batch])
            rejected |= {
                req_id: t for (req_id, _, t), ok in zip(batch, took, strict=True) if not ok
            }
        for req_id, token in rejected.items():  # NOTE: not with the mask applied; never crash
            log.error("%s: token %s violates its grammar; ending the request", req_id, token)
        return [r for r, m, _ in rows if r in rejected or m.terminated]
