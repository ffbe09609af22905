"""What a step costs: seconds as a function of the tokens it computes, learnt from the
engine's own steps.

A step's time is close to linear in its tokens, t ≈ a + b·n: `a` is the fixed cost (the
weights read once, kernel launches, Python), `b` what each token adds. The ratio is the
whole story of priority under batching. On a GPU decoding is memory-bound, b is tiny and
a lower class riding along costs the higher one nothing; on a CPU b is large and every
token a batch line adds to the step is paid by the online request in the same step. The
scheduler asks `extra_tokens` how many lower-class tokens fit in a step without making
it more than `slack` longer than the higher class's work alone.

The fit is kvfleet.linear_fit's: least squares over the recent steps, older ones
weighing less, so it follows a change of load or of device without keeping a history.
"""

from __future__ import annotations

import math

from kvfleet.linear_fit import LinearFit


class StepCost(LinearFit):
    """Seconds a step takes (y) against the tokens it computes (x)."""

    def __init__(self, *, half_life_steps: float = 256.0, min_steps: int = 16) -> None:
        super().__init__(half_life=half_life_steps, min_samples=min_steps)

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
