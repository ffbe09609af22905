"""Publishes this worker's KV capacity and load to Redis, under a key that expires.

The scheduler sums the live heartbeats to know how many KV tokens the fleet can hold.
The key's TTL is three write intervals, so one slow write does not drop the worker,
and a dead worker stops counting within `WORKER_HEARTBEAT_TTL_S`.
"""

from __future__ import annotations

import logging
import threading

from typing import Callable

import msgspec
import redis

from kvfleet import constants
from kvfleet.contracts import WorkerHeartbeat

log = logging.getLogger("kvfleet.worker")


class Heartbeat:
    def __init__(self, client: redis.Redis, key: str, snapshot: Callable[[], WorkerHeartbeat], *,
                 ttl_s: float = constants.WORKER_HEARTBEAT_TTL_S) -> None:
        self.client = client
        self.key = key
        self.snapshot = snapshot
        self.ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def beat(self) -> None:
        self.client.set(self.key, msgspec.json.encode(self.snapshot()), px=self.ttl_ms)

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
            self.client.delete(self.key)
        except redis.RedisError:
            pass  # the TTL removes it anyway


