"""The fleet's capacity: the KV tokens of every worker that is alive right now.

Each worker writes a `kvfleet.contracts.WorkerHeartbeat` (JSON) to
`{prefix}:worker:{worker_id}` every third of WORKER_HEARTBEAT_TTL_S with that TTL
(`workers/heartbeat.py` through `kvfleet/registry.py`), so a worker that stops
heartbeating (crashed, partitioned, stopped) drops out of the sum within the TTL, with
no cleanup needed. The scheduler budgets with it, the API reads it for its load check.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import redis

from kvfleet import registry
from kvfleet.constants import Keys
from kvfleet.contracts import WorkerHeartbeat


class FleetCapacity:
    """Sum of live workers' `capacity_tokens`, optionally capped by `ceiling_tokens`
    (an operator's limit, e.g. while a model rollout shares the GPUs)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ceiling_tokens: Optional[int] = None,
                 cache_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ceiling_tokens is not None and ceiling_tokens <= 0:
            raise ValueError(f"ceiling_tokens={ceiling_tokens} must be > 0 (or None for no ceiling)")
        self.client = client
        self.keys = keys
        self.ceiling_tokens = ceiling_tokens
        # Capacity changes at heartbeat pace, not per poll: a scheduler ticking every
        # 200 ms reads the registry at most once per cache_s.
        self.cache_s = cache_s
        self._clock = clock
        self._cached: Optional[tuple[float, int]] = None

    def heartbeats(self) -> list[WorkerHeartbeat]:
        return registry.live(self.client, self.keys)

    def read(self) -> int:
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        total = sum(b.capacity_tokens for b in self.heartbeats())
        if self.ceiling_tokens is not None:
            total = min(total, self.ceiling_tokens)
        self._cached = (now, total)
        return total
