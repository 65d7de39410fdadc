"""What a step costs in time, learnt from the steps run: the token budget that keeps a step
within ``max_step_ms``.

A request that arrives while a step runs waits for that step, then for its own: the longest
step bounds every newcomer's time to first token and every running stream's inter-token gap.
A token budget alone cannot bound it across machines (a 2048-token step is tens of ms on a
GPU, seconds on two CPU cores), so the scheduler sizes the step from this fit of

    seconds = fixed + per_unit * prefill_units + per_row * decode_rows + per_read * context

(units: budget units, as ``Scheduler._chunk`` counts them; a decode row is not a prefill
token: on a CPU its attention gathers its whole context; ``context``: the tokens of KV the
step's rows attend to, which a small chunk of a long prompt pays for again each step), least
squares with exponential forgetting, updated as each step retires. While the steps seen do not
tell the terms apart, simpler fits stand in (without the context; one cost per unit of either
kind; all the time on the units, an upper bound on the unit cost: the budget errs short).

A step never has less prefill than its unavoidable cost (fixed, decodes, context) would
justify: below that, chunks shrink only to pay that cost more often. So a step lasts at most
the longer of ``max_step_ms`` and twice its unavoidable cost, and a capped prefill keeps at
least half of its uncapped throughput.
"""

from __future__ import annotations

import numpy as np

MIN_SAMPLES = 4
"""Steps seen before the fit is used (until then the budget is uncapped)."""
REFIT_EVERY = 4
"""Steps between two solves of the fit (each about 40 us; the scheduler asks every step)."""


class StepCost:
    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.samples = 0
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._fit: tuple[float, float, float, float] | None = None
        self._fit_at = 0

    def observe(self, prefill_units: float, decode_rows: int, context: int, seconds: float):
        """A retired step: its prefill budget units, decode rows, KV tokens read, device time."""
        if prefill_units + decode_rows <= 0 or seconds <= 0:
            return
        x = np.array([1.0, prefill_units, decode_rows, context])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float, float, float] | None:
        """(fixed seconds, per prefill unit, per decode row, per context token), or None
        before ``MIN_SAMPLES`` steps; solved again once ``REFIT_EVERY`` more have come."""
        if self.samples < MIN_SAMPLES:
            return None
        if self._fit is None or self.samples - self._fit_at >= REFIT_EVERY:
            self._fit, self._fit_at = self._refit(), self.samples
        return self._fit

    def _refit(self) -> tuple[float, float, float, float]:
        for terms in _MODELS:  # NOTE: columns of x each model keeps (pooling rows and units)
            beta = _solve(terms.T @ self._xx @ terms, terms.T @ self._xy)
            if beta is not None:
                return tuple(float(v) for v in terms @ beta)
        units = self._xx[0, 1] + self._xx[0, 2]
        per_unit = self._xy[0] / units
        return 0.0, per_unit, per_unit, 0.0

    def units_within(self, seconds: float, decode_rows: int = 0, context: int = 0) -> int | None:
        """The most budget units (``decode_rows`` decodes and prefill units) a step reading
        ``context`` KV tokens may hold to last at most ``seconds``, or as long as its
        unavoidable cost again (see the module docstring); None while the cost is not known."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_unit, per_row, per_read = fit
        unavoidable = fixed + per_row * decode_rows + per_read * context
        prefill = max(seconds - unavoidable, unavoidable) / per_unit
        return decode_rows + max(1, int(prefill + 1e-6))


_MODELS = (
    np.eye(4),
    np.eye(4)[:, :3],
    np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]),
)
"""Each fit's terms as a map from its coefficients to the four of ``fit``: all; no context;
one cost per unit of either kind."""


def _solve(xx: np.ndarray, xy: np.ndarray) -> np.ndarray | None:
    """Least squares from the normal equations, or None if ill-posed or a cost < 0."""
    if np.linalg.cond(xx) > 1e10:
        return None
    beta = np.linalg.solve(xx, xy)
    if beta[0] < 0 or (beta[1:] <= 0).any():
        return None
    return beta
