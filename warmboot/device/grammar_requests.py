"""Structured outputs for the engine: one grammar matcher per constrained request, the step's
token bitmask, and advancing the matchers by committed tokens. The xgrammar side is
``grammar_backend`` (compiling specs, matchers) and ``grammar_bitmask`` (the bitmask and its
kernels); xgrammar is loaded on the first constrained request. Compiles run on the pool of
``grammar_compiles`` (``compiles``), before a request is queued: ``add`` finds the grammar
compiled.

The loop asks for a step's bitmask only when it enqueues that step's sample, i.e. after the
previous step was committed and the matchers advanced ("forward now, sample later").
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from warmboot.core.types import ScheduledRequest, TokenEvent
from warmboot.device.grammar_backend import GrammarBackend
from warmboot.device.grammar_bitmask import allocate_bitmask
from warmboot.device.grammar_compiles import GrammarCompiles
from warmboot.sampling_params import StructuredOutputs

log = logging.getLogger("warmboot")


class GrammarRequests:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        args = (tokenizer_json, vocab_size, eos_token_ids)
        self.compiles = GrammarCompiles(functools.partial(GrammarBackend, *args))
        """The compile service: its pool compiles, its backend caches."""
        self.vocab_size = vocab_size
        self.matchers: dict[str, object] = {}

    @property
    def backend(self):
        """The xgrammar backend, created (and xgrammar imported) on first use."""
        return self.compiles.backend

    def compile(self, spec: StructuredOutputs) -> object:
        """Compile (cached; on the compile pool, waiting at most its time limit) or raise
        ``InvalidRequestError`` (a ``ValueError``) naming what is wrong with the spec."""
        return self.compiles.compile(spec)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        """Start ``req_id``'s matcher (engine thread): the grammar was compiled on validation,
        so this is a cache lookup; an uncompiled spec is compiled here, blocking."""
        compiled = self.compiles.cached(spec) or self.compiles.compile(spec)
        self.matchers[req_id] = self.backend.matcher(compiled)

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
