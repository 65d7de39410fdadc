"""What a step costs in time, learnt from the steps run: the token budget that keeps a step
within ``max_step_ms``.

A request that arrives while a step runs waits for that step, then for its own: the longest
step bounds every newcomer's time to first token and every running stream's inter-token gap.
A token budget alone cannot bound it across machines (a 2048-token step is tens of ms on a
GPU, seconds on two CPU cores), so the scheduler sizes the step from this fit of
``seconds = fixed + per_unit * units`` (units: budget units, as ``Scheduler._chunk`` counts
them), least squares with exponential forgetting, updated as each step retires.
"""

from __future__ import annotations

MIN_SAMPLES = 4
"""Steps seen before the fit is used (until then the budget is uncapped)."""


class StepCost:
    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, units: float, seconds: float) -> None:
        """A retired step: its budget units and its device time."""
        if units <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + units
        self._y = d * self._y + seconds
        self._xx = d * self._xx + units * units
        self._xy = d * self._xy + units * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit), or None before ``MIN_SAMPLES`` steps. With too
        little spread in step sizes to separate the two, all the time is put on the units
        (an upper bound on the unit cost: the budget errs short)."""
        if self.samples < MIN_SAMPLES:
            return None
        w, x, y = self._w, self._x, self._y
        spread = w * self._xx - x * x
        if spread > 1e-9 * w * self._xx:
            per_unit = (w * self._xy - x * y) / spread
            fixed = (y - per_unit * x) / w
            if per_unit > 0 and fixed >= 0:
                return fixed, per_unit
        return 0.0, y / x

    def units_within(self, seconds: float) -> int | None:
        """The most units a step may hold to last at most ``seconds`` (at least 1), or None
        while the cost is not known yet."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_unit = fit
        return max(1, int((seconds - fixed) / per_unit + 1e-6))
