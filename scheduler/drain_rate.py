"""How fast the policy's buffer drains: tokens admitted per second while jobs wait.

While jobs wait for the budget, every token a finishing job frees goes to a waiting
one (the policy is work-conserving), so the tokens admitted per second of such a
backlog are the fleet's service rate, as this replica sees it: measured on its own
admissions, it agrees with its own buffer also when replicas share the fleet. Seconds
with nothing waiting measure the arrivals, not the fleet, and are left out; so a quiet
hour neither lowers the rate nor forgets it.

Pure, no clock: `Policy.schedule` passes `now` in.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

#: Seconds of backlog the rate averages over. Long enough to span many finishing jobs
#: (a fleet at capacity admits hundreds in that time, and a hold's lump of tokens is
#: one of them); short enough to follow a worker lost or added within half a minute.
WINDOW_S = 30.0


class DrainRate:
    """Tokens admitted per second of backlog, over the last `window_s` seconds of it."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._intervals: deque[tuple[float, int]] = deque()  # (seconds, tokens admitted), oldest first
        self._busy_s = 0.0
        self._tokens = 0
        self._last: Optional[float] = None  # the previous call's `now`, if it left jobs waiting

    def record(self, now: float, admitted_tokens: int, *, waiting: bool) -> None:
        """One `schedule()` call: the tokens it admitted, and whether jobs still wait after it.

        The interval since the previous call counts only if that call left jobs
        waiting: what was admitted since then was backlog, taken as fast as the fleet
        freed it."""
        if self._last is not None and now > self._last:
            self._intervals.append((now - self._last, admitted_tokens))
            self._busy_s += now - self._last
            self._tokens += admitted_tokens
            # Keep at least one window: drop the oldest only while the rest still covers it.
            while self._busy_s - self._intervals[0][0] >= self.window_s:
                seconds, tokens = self._intervals.popleft()
                self._busy_s -= seconds
                self._tokens -= tokens
        self._last = now if waiting else None

    def tokens_per_s(self) -> Optional[float]:
        """The rate over the last window of backlog; None until a whole window was seen
        (a rate from a few seconds would be a guess), or if nothing was admitted in it."""
        if self._busy_s < self.window_s or self._tokens <= 0:
            return None
        return self._tokens / self._busy_s
