"""Host side of constrained decoding: one grammar matcher per constrained request.

The loop asks for a step's bitmask only when it enqueues that step's sample, i.e. after the
previous step was committed and the matchers advanced ("forward now, sample later").
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from warmboot.engine.runner import StepHandle
from warmboot.engine.scheduler import TokenEvent
from warmboot.sampling_params import StructuredOutputs

log = logging.getLogger("warmboot")


class GrammarRequests:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        from warmboot.engine.grammar import GrammarBackend

        self.backend = GrammarBackend(tokenizer_json, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.matchers: dict[str, object] = {}

    def compile(self, spec: StructuredOutputs) -> object:
        """Compile (cached) or raise ValueError naming what is wrong with the spec."""
        return self.backend.compile(spec)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        self.matchers[req_id] = self.backend.matcher(self.backend.compile(spec))

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def bitmask(self, handle: StepHandle) -> torch.Tensor | None:
        """(rows, vocab/32) int32 mask of the step's sampling rows, or None if none is
        constrained. Rows without a live matcher (free or zombie rows) allow everything."""
        from warmboot.engine.grammar import allocate_bitmask

        rows = handle.inputs.sample_rows if handle.inputs is not None else []
        live = [(i, self.matchers.get(s.req_id)) for i, s in enumerate(rows)]
        live = [(i, m) for i, m in live if m is not None and not m.terminated]
        if not live:
            return None
        mask = allocate_bitmask(len(rows), self.vocab_size)
        self.backend.fill_bitmasks([m for _, m in live], mask, [i for i, _ in live])
        return mask

    def accept(self, events: list[TokenEvent]) -> list[str]:
        """Advance the matchers by the committed tokens; return requests whose grammar ended."""
        ended = []
        for ev in events:
            req_id = ev.request.request_id
            matcher = self.matchers.get(req_id)
            if matcher is None or ev.finished:
                continue
            rejected = [t for t in ev.new_token_ids if not matcher.accept(t)]
            if rejected:  # NOTE: cannot happen with the mask applied; end it, never crash
                log.error("%s: token %s violates its grammar; ending the request", req_id, rejected)
            if rejected or matcher.terminated:
                ended.append(req_id)
        return ended
