"""The per-request sampling state the runner keeps from step to step: a seeded request's
generator (on the device, so its draws continue where the last step left them) and a
penalised request's token histories (prompt and committed output as host tensors, extended by
``record``). ``row`` turns a scheduled request into the ``SamplingRow`` the sampler reads."""

from __future__ import annotations

import torch

from warmboot.core.types import ScheduledRequest, TokenEvent
from warmboot.device.sampler import SamplingRow, TokenHistory, make_generator


class SamplingState:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.histories: dict[str, tuple[TokenHistory, TokenHistory]] = {}
        """Per penalised request: its prompt and committed output as host tensors."""

    def track(self, s: ScheduledRequest) -> None:
        """Start the penalty histories of a penalised request (once)."""
        if s.params.uses_penalties and s.req_id not in self.histories:
            prompt = TokenHistory()
            prompt.extend(s.prompt_token_ids)
            self.histories[s.req_id] = (prompt, TokenHistory())

    def record(self, events: list[TokenEvent]) -> None:
        """Committed tokens, appended to the penalty histories."""
        for ev in events:
            histories = self.histories.get(ev.req_id)
            if histories is not None:
                histories[1].extend(ev.new_token_ids)

    def row(self, s: ScheduledRequest) -> SamplingRow:
        """The sampler's row for ``s``; a seeded request's generator is made on first use."""
        gen = None
        if s.params.seed is not None:
            gen = self.generators.get(s.req_id)
            if gen is None:
                gen = self.generators[s.req_id] = make_generator(s.params.seed, self.device)
        prompt, output = s.prompt_token_ids, ()
        histories = self.histories.get(s.req_id)
        if histories is not None:  # NOTE: tensors, so the sampler converts no list per step
            prompt, output = histories[0].tensor, histories[1].tensor
        return SamplingRow(
            params=s.params,
            prompt_token_ids=prompt,
            output_token_ids=output,
            generator=gen,
            suppress_token_ids=s.suppress_token_ids,
        )

    def forget(self, req_id: str) -> None:
        """Drop a finished request's generator and histories."""
        self.generators.pop(req_id, None)
        self.histories.pop(req_id, None)

    def clear(self) -> None:
        self.generators.clear()
        self.histories.clear()

    @property
    def req_ids(self) -> set[str]:
        """Requests with a generator or penalty histories."""
        return set(self.generators) | set(self.histories)
