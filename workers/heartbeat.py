"""Publishes this worker's KV capacity to Redis, under a key that expires.

The scheduler sums the live heartbeats to know how many KV tokens the fleet can hold.
The key's TTL is three write intervals, so one slow write does not drop the worker,
and a dead worker stops counting within `WORKER_HEARTBEAT_TTL_S`.
"""

from __future__ import annotations

import logging
import threading

from typing import Callable

import redis

from kvfleet import constants, registry
from kvfleet.constants import Keys
from kvfleet.contracts import WorkerHeartbeat

log = logging.getLogger("kvfleet.worker")


class Heartbeat:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, snapshot: Callable[[], WorkerHeartbeat], *,
                 ttl_s: float = constants.WORKER_HEARTBEAT_TTL_S) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.snapshot = snapshot
        self.ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def beat(self) -> None:
        registry.publish(self.client, self.keys, self.snapshot(), ttl_ms=self.ttl_ms)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat write failed", extra={"error": str(exc)})

    def stop(self) -> None:
        """Stop beating and withdraw the capacity at once (a clean shutdown)."""
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            registry.withdraw(self.client, self.keys, self.worker_id)
        except redis.RedisError:
            pass  # the TTL removes it anyway


