"""y ≈ a + b·x, fitted by least squares over recent observations, older ones weighing
less (a half-life in observations), so the fit follows a change of load or device
without keeping a history. The engine fits step time against tokens with it
(workers/engine/step_cost.py), the cold tier fetch time against bytes (kvstore/decision.py).
"""

from __future__ import annotations


class LinearFit:
    def __init__(self, *, half_life: float = 256.0, min_samples: int = 16) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._min_samples = min_samples  # below this, no fit: the first samples include warm-up
        self._samples = 0
        # Decayed sums of weight, x, x², y and x·y: the normal equations of the fit.
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y
        self._samples += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the samples cannot tell them apart (too few, or all at
        one x)."""
        if self._samples < self._min_samples:
            return None
        det = self._w * self._xx - self._x * self._x
        if det <= 1e-9 * self._w * self._xx:  # all at (nearly) one x: the slope is not determined
            return None
        b = (self._w * self._xy - self._x * self._y) / det
        a = (self._y - b * self._x) / self._w
        return a, b
