"""The fleet's capacity: the KV tokens and job slots of every worker alive right now.

Each worker writes a `kvfleet.contracts.WorkerHeartbeat` (JSON) to
`{prefix}:worker:{worker_id}` every third of WORKER_HEARTBEAT_TTL_S with that TTL
(`workers/heartbeat.py` through `kvfleet/registry.py`), so a worker that stops
heartbeating (crashed, partitioned, stopped) drops out of the sum within the TTL, with
no cleanup needed. The scheduler budgets with it, the API reads it for its load check.

Slots are the jobs a worker runs at once (its Celery task threads). The budget counts
them beside tokens: a fleet with tokens to spare but every thread busy would otherwise
admit jobs that only wait in the Celery queue, past their admission lease.

Jobs per message: the most jobs one Celery message may carry for every live worker to
take it (`WorkerHeartbeat.jobs_per_message`), so a fleet with one worker from before
multi-job messages gets one job per message until that worker is gone.
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
        self._cached: Optional[tuple[float, tuple[int, int, int, int]]] = None

    def heartbeats(self) -> list[WorkerHeartbeat]:
        return registry.live(self.client, self.keys)

    def read(self) -> int:
        """KV tokens the live workers hold, capped by the ceiling."""
        return self._read()[0]

    def slots(self) -> int:
        """Jobs the live workers run at once; 0 = no limit (a worker that does not
        report its slots, from before they were counted)."""
        return self._read()[1]

    def jobs_per_message(self) -> int:
        """The most jobs a Celery message may carry for any live worker (1: no worker,
        or one that takes a job per message only)."""
        return self._read()[2]

    def workers(self) -> int:
        """How many workers are alive."""
        return self._read()[3]

    def _read(self) -> tuple[int, int, int, int]:
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        beats = self.heartbeats()
        tokens = sum(b.capacity_tokens for b in beats)
        if self.ceiling_tokens is not None:
            tokens = min(tokens, self.ceiling_tokens)
        slots = 0 if any(b.slots <= 0 for b in beats) else sum(b.slots for b in beats)
        per_message = max(1, min((b.jobs_per_message for b in beats), default=1))
        self._cached = (now, (tokens, slots, per_message, len(beats)))
        return tokens, slots, per_message, len(beats)
