"""What a step costs in time, learnt from the steps run: the token budget that keeps a step
within ``max_step_ms``.

A request that arrives while a step runs waits for that step, then for its own: the longest
step bounds every newcomer's time to first token and every running stream's inter-token gap.
A token budget alone cannot bound it across machines (a 2048-token step is tens of ms on a
GPU, seconds on two CPU cores), so the scheduler sizes the step from this fit of

    seconds = fixed + per_unit * prefill_units + per_row * decode_rows

(units: budget units, as ``Scheduler._chunk`` counts them; a decode row is not a prefill
token: on a CPU its attention gathers its whole context), least squares with exponential
forgetting, updated as each step retires. While the steps seen do not tell the terms apart
(all decode, or all the same size), simpler fits stand in: one cost per unit of either kind,
then all the time put on the units (an upper bound on the unit cost: the budget errs short).
"""

from __future__ import annotations

import numpy as np

MIN_SAMPLES = 4
"""Steps seen before the fit is used (until then the budget is uncapped)."""


class StepCost:
    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.samples = 0
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)

    def observe(self, prefill_units: float, decode_rows: int, seconds: float) -> None:
        """A retired step: its prefill budget units, its decode rows and its device time."""
        if prefill_units + decode_rows <= 0 or seconds <= 0:
            return
        x = np.array([1.0, prefill_units, decode_rows])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per prefill unit, seconds per decode row), or None before
        ``MIN_SAMPLES`` steps."""
        if self.samples < MIN_SAMPLES:
            return None
        full = _solve(self._xx, self._xy)
        if full is not None:
            return full
        # one cost for a unit of either kind: x = (1, units + rows)
        t = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
        pooled = _solve(t.T @ self._xx @ t, t.T @ self._xy)
        if pooled is not None:
            return pooled[0], pooled[1], pooled[1]
        units = self._xx[0, 1] + self._xx[0, 2]
        per_unit = self._xy[0] / units
        return 0.0, per_unit, per_unit

    def units_within(self, seconds: float, decode_rows: int = 0) -> int | None:
        """The most budget units (``decode_rows`` decodes and prefill units) a step may hold to
        last at most ``seconds`` (at least the decodes plus one), or None while the cost is
        not known yet."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_unit, per_row = fit
        prefill = (seconds - fixed - per_row * decode_rows) / per_unit
        return decode_rows + max(1, int(prefill + 1e-6))


def _solve(xx: np.ndarray, xy: np.ndarray) -> tuple[float, ...] | None:
    """Least squares from the normal equations, or None if ill-posed or not all >= 0."""
    if np.linalg.cond(xx) > 1e10:
        return None
    beta = np.linalg.solve(xx, xy)
    if beta[0] < 0 or (beta[1:] <= 0).any():
        return None
    return tuple(float(b) for b in beta)
