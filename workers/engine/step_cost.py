"""What a step costs: seconds as a function of the tokens it computes, learnt from the
engine's own steps.

A step's time is close to linear in its tokens, t ≈ a + b·n: `a` is the fixed cost (the
weights read once, kernel launches, Python), `b` what each token adds. The ratio is the
whole story of priority under batching. On a GPU decoding is memory-bound, b is tiny and
a lower class riding along costs the higher one nothing; on a CPU b is large and every
token a batch line adds to the step is paid by the online request in the same step. The
scheduler asks `extra_tokens` how many lower-class tokens fit in a step without making
it more than `slack` longer than the higher class's work alone.

The fit is least squares over the recent steps, older ones weighing less (a half-life in
steps), so it follows a change of load or of device without keeping a history.
"""

from __future__ import annotations

import math


class StepCost:
    def __init__(self, *, half_life_steps: float = 256.0, min_steps: int = 16) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._min_steps = min_steps  # below this, no fit: the first steps include warm-up
        self._steps = 0
        # Decayed sums of weight, n, n², t and n·t: the normal equations of the fit.
        self._w = self._n = self._nn = self._t = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self._decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + tokens
        self._nn = self._nn * d + tokens * tokens
        self._t = self._t * d + seconds
        self._nt = self._nt * d + tokens * seconds
        self._steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a seconds, b seconds per token), or None while the steps seen cannot tell them
        apart (too few, or all of one size)."""
        if self._steps < self._min_steps:
            return None
        det = self._w * self._nn - self._n * self._n
        # All steps of (nearly) one size: the slope is not determined by the data.
        if det <= 1e-9 * self._w * self._nn:
            return None
        b = (self._w * self._nt - self._n * self._t) / det
        a = (self._t - b * self._n) / self._w
        return a, b

    def extra_tokens(self, tokens: int, slack: float) -> int | None:
        """Tokens a step of `tokens` may add and stay within (1 + slack) times its own
        predicted time; None when there is no bound (no fit yet, a slope of zero or less,
        or an infinite slack). At least 1, so that what rides along is never starved."""
        fitted = None if math.isinf(slack) else self.fit()
        if fitted is None:
            return None
        a, b = fitted
        if b <= 0.0:
            return None
        alone = max(a + b * tokens, b)  # a negative intercept (noise) must not forbid everything
        return max(1, int(slack * alone / b))
