"""What a step costs in time, learnt from the steps run: the token budget that keeps a step
within ``max_step_ms``.

A request that arrives while a step runs waits for that step, then for its own: the longest
step bounds every newcomer's time to first token and every running stream's inter-token gap.
A token budget alone cannot bound it across machines (a 2048-token step is tens of ms on a
GPU, seconds on two CPU cores), so the scheduler sizes the step from this fit of

    seconds = fixed + per_unit * prefill_units + per_row * decode_rows + per_read * context
              + per_logprob * prompt_logprob_tokens

(units: prefill tokens; a decode row is not a prefill token: on a CPU its attention gathers
its whole context; ``context``: the (query token, KV token) pairs the step's attention scores,
a decode row its context, a prefill chunk of n tokens from position s about n * s: the
native kernels read a chunk's earlier KV once per query token, so 16 siblings' 8-token tails
over a 1000-token prompt cost about what 128 decodes of that context do (170 ms where a
fit that counted a chunk's context once said 50); a prompt-logprob token adds an LM head over
the vocabulary, a log-softmax and a top-k), least squares with exponential forgetting, updated
as each step retires. While the steps seen do not tell the terms apart, simpler fits stand in
(without the context or the prompt logprobs; one cost per unit of either kind; all the time on
the units, an upper bound on the unit cost: the budget errs short).

The scheduler counts a prompt-logprob token ``logprob_weight`` units: with ``learn_weight``,
``1 + per_logprob / per_unit`` from the last fit that told them apart (the demo model's
compiled steps offline: 3-4). Priced at a fixed 1.4 and fitted in weighted units, an echo
request's chunks in a server had run 300-420 ms past a 250 ms cap.

A step never has less prefill than its unavoidable cost (fixed, decodes, context) would
justify: below that, chunks shrink only to pay that cost more often. So a step lasts at most
the longer of ``max_step_ms`` and twice its unavoidable cost, and a capped prefill keeps at
least half of its uncapped throughput.
"""

from __future__ import annotations

import math

import numpy as np

MIN_SAMPLES = 4
"""Steps seen before the fit is used (until then the budget is uncapped)."""
REFIT_EVERY = 4
"""Steps between two solves of the fit (each about 40 us; the scheduler asks every step)."""
MAX_WEIGHT = 32.0
"""The most a learnt prompt-logprob token weighs (a fit on few, alike steps can be wild)."""


class StepCost:
    def __init__(self, logprob_weight: float = 1.0, learn_weight=False, decay: float = 0.95):
        self.decay = decay
        self.samples = 0
        self._xx = np.zeros((5, 5))
        self._xy = np.zeros(5)
        self._yy = 0.0
        self._fit: tuple[float, float, float, float] | None = None
        self._fit_at = 0
        self._weight, self._learn = logprob_weight, learn_weight
        self._read = 0.0

    def observe(
        self,
        prefill_units: float,
        decode_rows: int,
        context: int,
        seconds: float,
        logprob_tokens: int = 0,
    ):
        """A retired step: its prefill tokens, decode rows, attention pairs (``context``),
        device time, and the prompt-logprob tokens among its prefill tokens."""
        if prefill_units + decode_rows <= 0 or seconds <= 0:
            return
        x = np.array([1.0, prefill_units, decode_rows, context, logprob_tokens])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self._yy = self.decay * self._yy + seconds * seconds
        self.samples += 1

    def read_weight(self, start: int) -> float:
        """Budget units a prefill token from position ``start`` adds for the earlier KV it
        reads: a cached prefix or a long prompt's earlier chunks are read again by each token
        of a chunk. Priced by the last fit that had a context term (0 before one had)."""
        fit = self.fit()
        return self._read * start / fit[1] if fit and start else 0.0

    @property
    def logprob_weight(self) -> float:
        """Budget units a prompt-logprob token counts (see the module docstring)."""
        self.fit()
        return self._weight

    def fit(self) -> tuple[float, float, float, float] | None:
        """(fixed seconds, per prefill unit, per decode row, per context token), or None
        before ``MIN_SAMPLES`` steps; solved again once ``REFIT_EVERY`` more have come."""
        if self.samples < MIN_SAMPLES:
            return None
        if self._fit is None or self.samples - self._fit_at >= REFIT_EVERY:
            self._fit, self._fit_at = self._refit(), self.samples
        return self._fit

    def _refit(self) -> tuple[float, float, float, float]:
        best, least = None, math.inf
        for terms in _MODELS:  # NOTE: columns of x each model keeps (pooling rows and units)
            xx, xy = terms.T @ self._xx @ terms, terms.T @ self._xy
            beta = _solve(xx, xy)
            if beta is not None and (rss := self._yy - 2 * beta @ xy + beta @ xx @ beta) < least:
                best, least = terms @ beta, rss - 1e-12 * abs(rss)  # NOTE: ties: the richer
        if best is not None:
            fixed, per_unit, per_row, per_read, per_logprob = best
            if per_logprob and self._learn:
                self._weight = float(min(1 + per_logprob / per_unit, MAX_WEIGHT))
            self._read = float(per_read) or self._read
            return float(fixed), float(per_unit), float(per_row), float(per_read)
        units = self._xx[0, 1] + self._xx[0, 2]
        per_unit = self._xy[0] / units
        return 0.0, per_unit, per_unit, 0.0

    def units_within(
        self, seconds: float, decode_rows: int = 0, context: int = 0, stretch: bool = True
    ) -> int | None:
        """The most budget units (``decode_rows`` decodes and prefill units) a step reading
        ``context`` KV tokens may hold to last at most ``seconds``, or (``stretch``) as long
        as its unavoidable cost again (see the module docstring); None while the cost is not
        known."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_unit, per_row, per_read = fit
        unavoidable = fixed + per_row * decode_rows + per_read * context
        prefill = max(seconds - unavoidable, unavoidable) if stretch else seconds - unavoidable
        prefill /= per_unit
        return decode_rows + max(1, int(prefill + 1e-6))


def _terms(*groups: tuple[int, ...]) -> np.ndarray:
    """A fit's map from its coefficients to the five of ``_refit``: each coefficient is the
    cost of the columns of its group (pooled), a column in none costs 0."""
    terms = np.zeros((5, len(groups)))
    for k, cols in enumerate(groups):
        terms[list(cols), k] = 1.0
    return terms


_MODELS = tuple(
    _terms(*groups)
    for groups in (
        [(0,), (1,), (2,), (3,), (4,)],
        [(0,), (1,), (2,), (4,)],
        [(0,), (1,), (2,), (3,)],
        [(0,), (1,), (2,)],
        [(0,), (1, 2), (4,)],
        [(0,), (1, 2)],
    )
)
"""The fits tried: all; no context; no prompt logprobs; neither; one cost per unit of either
kind, with and without prompt logprobs. The one that explains the steps seen best serves (a
richer one on a tie): where the full fit fails (a cost below zero) the context term is kept
if the steps need it, not dropped for the first simpler fit that solves."""


def _solve(xx: np.ndarray, xy: np.ndarray) -> np.ndarray | None:
    """Least squares from the normal equations, or None if ill-posed or a cost < 0."""
    if np.linalg.cond(xx) > 1e10:
        return None
    beta = np.linalg.solve(xx, xy)
    if beta[0] < 0 or (beta[1:] <= 0).any():
        return None
    return beta
