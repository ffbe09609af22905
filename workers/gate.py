"""A worker reads from the broker only the jobs its slots have room for.

Every worker's Celery consumer reads the same queues, so whichever reads first gets
the next message. Celery bounds what a worker holds in *messages* (one per thread,
`worker_prefetch_multiplier` 1), but a message may carry many jobs
(scheduler/dispatch.py `pack`), so one worker could take most of what the scheduler
admitted for the whole fleet and run that queue alone while the others had finished
theirs: in 500 jobs of 128 tokens on two workers, a split of 124/376 left one engine
idle for the last 1.1 s of a 3.3 s run (docs/benchmarks.md, "Jobs a worker holds").

`JobGate` counts the jobs this process holds, from the moment a task starts until its
jobs end, in the scheduler's terms: a worker's heartbeat offers `slots` (its Celery
threads), of which the scheduler gives normal and low jobs all but the
`high_slot_reserve` share (scheduler/policy.py). The consumer step below reads a
class's queue only while this worker holds fewer jobs than that class may have here:
normal and low below `shared`, high below `slots`. What does not fit waits in the
broker's queue for whichever worker has room first, so when the fleet is full each
worker holds its share, and a high job still finds a reserved slot at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

from celery import Celery, bootsteps
from prometheus_client import Gauge

from kvfleet import constants
from kvfleet.contracts import Priority

log = logging.getLogger("kvfleet.worker")

#: The timeout of a BRPOP of the high queue alone (normal's and low's closed), in
#: seconds: once they reopen, the worker reads them again within this. Redis takes a
#: fraction of a second since 6.0.
HIGH_ONLY_BRPOP_S = 0.05

HELD_JOBS = Gauge("kvfleet_worker_held_jobs", "Jobs this worker holds (delivered, not ended), by class group",
                  ["group"])


def _turn() -> None:
    """Nothing: the loop's turn that follows it sends the BRPOP the gate held back."""


class JobGate:
    def __init__(self, slots: int, high_slot_reserve: float, key_prefix: str) -> None:
        self.slots = slots
        #: As the scheduler splits a worker's slots (`high_slots=int(reserve * slots)`).
        self.shared = max(1, slots - int(high_slot_reserve * slots))
        self.high_queue = constants.celery_queue(key_prefix, Priority.HIGH)
        self._held = {"high": 0, "shared": 0}
        self._lock = threading.Lock()
        #: Wakes the consumer's event loop (set by `install`): a queue that opens while
        #: the loop sleeps in its poll would otherwise wait for its next timer (up to 1 s).
        self._wake: Optional[Callable[[], object]] = None

    @staticmethod
    def _group(raws: list[object]) -> str:
        # A message's jobs share a class (`pack`); a payload that does not say counts as shared.
        first = raws[0] if raws else None
        return "high" if isinstance(first, dict) and first.get("priority") == Priority.HIGH.value else "shared"

    def hold(self, raws: Iterable[object]) -> tuple[str, int]:
        """Count a message's jobs as held; returns what `release` gives back."""
        raws = list(raws)
        group = self._group(raws)
        with self._lock:
            self._held[group] += len(raws)
            HELD_JOBS.labels(group).set(self._held[group])
        return group, len(raws)

    def release(self, held: tuple[str, int]) -> None:
        group, n = held
        with self._lock:
            closed = self._closed()
            self._held[group] -= n
            HELD_JOBS.labels(group).set(self._held[group])
            reopened = closed != self._closed()
        if reopened and self._wake is not None:
            self._wake()

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def admits(self, queue: str) -> bool:
        """Whether to read `queue` now: room for its class's jobs here."""
        with self._lock:
            high_closed, shared_closed = self._closed()
        return not (high_closed if queue == self.high_queue else shared_closed)

    def shared_open(self) -> bool:
        with self._lock:
            return not self._closed()[1]

    def _closed(self) -> tuple[bool, bool]:
        """(high's queue closed, normal's and low's closed), under the lock."""
        total = self._held["high"] + self._held["shared"]
        return total >= self.slots, total >= self.slots or self._held["shared"] >= self.shared

    def install(self, app: Celery) -> None:
        """Make `app`'s worker consumer read a queue only while the gate admits it."""
        gate = self

        class Gate(bootsteps.StartStopStep):
            # After the task consumer (re)starts: every reconnection builds a new channel.
            requires = ("celery.worker.consumer.tasks:Tasks",)

            def start(self, c) -> None:
                gate.wrap(c.task_consumer.channel, c.hub)

        app.steps["consumer"].add(Gate)

    def wrap(self, channel, hub) -> None:
        """Gate a kombu Redis channel (kombu 5.7). Before each BRPOP it sends, the
        channel asks its queue cycle which queues to read (`Channel._brpop_start`), and
        sends none while the cycle names none; its poller asks again on every turn of
        the consumer's event loop."""
        cycle = getattr(channel, "_queue_cycle", None)
        if cycle is None:
            log.warning("the broker's channel has no queue cycle: this worker reads without its job gate")
            return
        names = cycle.consume
        cycle.consume = lambda n: [q for q in names(n) if self.admits(q)]
        brpop = channel._brpop_start

        def brpop_start(timeout=None):
            # A BRPOP of the high queue alone waits out its timeout even if the others
            # reopen meanwhile: a short one, so they are read again soon after.
            if timeout is None and not self.shared_open():
                timeout = HIGH_ONLY_BRPOP_S
            return brpop(timeout)

        channel._brpop_start = brpop_start
        if hub is not None:
            # With every queue closed no BRPOP is out, and the loop may sleep in its poll
            # until a timer: kombu's call_soon wakes it from the thread that reopens one.
            self._wake = lambda: hub.call_soon(_turn)
