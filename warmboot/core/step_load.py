"""What the running requests ask of the next step: the scheduler's sums over ``running``."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from warmboot.core.request import Request

Weight = Callable[[Request], float]
"""Budget units a token of a request's next prefill chunk counts (``Scheduler._weight``)."""


def running_load(running: Sequence[Request], weight: Weight) -> tuple[int, int, float]:
    """The running requests' decodes, the KV tokens those read, and the prefills' units."""
    decodes, context, prefill = 0, 0, 0.0
    for r in running:
        remaining = r.num_tokens - r.num_computed_tokens
        if remaining > 1:
            prefill += remaining * weight(r)
        else:
            decodes, context = decodes + 1, context + r.num_computed_tokens + 1
    return decodes, context, prefill


def claims_behind(
    running: Sequence[Request],
    budget: float,
    weight: Weight,
    small_units: float,
    skipped: Container[Request] = (),
) -> list[float]:
    """For each running request, the budget the requests after it claim before it takes a
    prefill chunk: a decode its token (unless the step leaves it out: ``skipped``), a prefill
    this step can finish (weighing at most ``small_units``) the rest of it, the prefills'
    claims at most half the budget. A small prompt admitted behind a long prefill is done in
    its next step (not a token a step), and a decode behind one is never squeezed out."""
    decodes, small = [0.0], [0.0]  # over the last k requests, k = 0, 1, ...
    for req in reversed(running):
        remaining = req.num_tokens - req.num_computed_tokens
        cost = remaining * weight(req)
        decodes.append(decodes[-1] + (remaining <= 1 and req not in skipped))
        small.append(small[-1] + (cost if remaining > 1 and cost <= small_units else 0))
    n = len(running)
    return [decodes[n - 1 - i] + min(small[n - 1 - i], budget / 2) for i in range(n)]
