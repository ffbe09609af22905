"""A worker's own health: is its engine still able to run jobs?

A fault in one engine step fails the jobs in flight and the engine goes on (a bad batch,
a transient error). A fault in every step (a CUDA error, a corrupted pool) is a sick
process that would keep heartbeating its capacity and fail every job sent to it. After
`threshold` failed steps in a row the worker calls itself unhealthy, once: the service
then drains it (capacity withdrawn at once, no new job started, running ones handed
back to their queues) and exits non-zero, for its supervisor to start a fresh process.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from workers.engine.stats import EngineStats

log = logging.getLogger("kvfleet.worker")


class EngineHealth:
    def __init__(self, stats: Callable[[], EngineStats], threshold: int, on_unhealthy: Callable[[], None]) -> None:
        self.stats = stats
        self.threshold = threshold
        self.on_unhealthy = on_unhealthy
        self.unhealthy = threading.Event()
        self._lock = threading.Lock()

    def check(self) -> bool:
        """Call after an engine fault; True once the worker is unhealthy."""
        faults = self.stats().consecutive_step_faults
        with self._lock:
            if self.unhealthy.is_set() or faults < self.threshold:
                return self.unhealthy.is_set()
            self.unhealthy.set()
        log.error("engine faulted in every step; worker unhealthy, draining and exiting",
                  extra={"consecutive_step_faults": faults})
        self.on_unhealthy()
        return True
