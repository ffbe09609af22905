"""The fleet's capacity: the KV tokens of every worker that is alive right now.

Each worker writes a `WorkerHeartbeat` to `{prefix}:worker:{worker_id}` every third of
WORKER_HEARTBEAT_TTL_S with that TTL, so a worker that stops heartbeating (crashed,
partitioned, stopped) drops out of the sum within the TTL, with no cleanup needed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import msgspec
import redis

from kvfleet import constants
from kvfleet.constants import Keys
from kvfleet.contracts import SCHEMA_VERSION

log = logging.getLogger(__name__)


class WorkerHeartbeat(msgspec.Struct, frozen=True):
    """A worker's state, as JSON in its heartbeat key."""

    worker_id: str
    #: KV tokens the worker's engine can hold (its block pool × block size).
    capacity_tokens: int
    tokens_in_use: int
    running: int  # sequences in the engine's running batch
    waiting: int  # jobs accepted but not yet in the batch
    sent_at: float  # unix seconds
    v: int = SCHEMA_VERSION


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerHeartbeat)


def publish_heartbeat(client: redis.Redis, keys: Keys, beat: WorkerHeartbeat, *,
                      ttl_s: float = constants.WORKER_HEARTBEAT_TTL_S) -> None:
    """What a worker calls every ttl_s / 3."""
    client.set(keys.worker(beat.worker_id), _encoder.encode(beat), px=int(ttl_s * 1000))


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
        # SCAN walks the whole keyspace, so a scheduler ticking every 200 ms reads at most
        # once per cache_s: capacity changes at heartbeat pace, not per poll.
        self.cache_s = cache_s
        self._clock = clock
        self._cached: Optional[tuple[float, int]] = None

    def heartbeats(self) -> list[WorkerHeartbeat]:
        names = list(self.client.scan_iter(match=self.keys.workers_pattern, count=1000))
        beats = []
        for name, raw in zip(names, self.client.mget(names) if names else []):
            if raw is None:
                continue  # expired between SCAN and MGET: the worker just died
            try:
                beats.append(_decoder.decode(raw))
            except msgspec.DecodeError as exc:
                # One bad writer must not zero the fleet's capacity: skip it, loudly.
                log.warning("ignoring malformed heartbeat %s: %s", name.decode(), exc)
        return beats

    def read(self) -> int:
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        total = sum(b.capacity_tokens for b in self.heartbeats())
        if self.ceiling_tokens is not None:
            total = min(total, self.ceiling_tokens)
        self._cached = (now, total)
        return total
