"""How loaded the fleet is, as the API sees it: each class's backlog and the budget's
utilisation, refreshed by a background thread about once a second so that a
submission never waits on Kafka or on a ledger read.

Backlog of a class = its topic's messages the scheduler group has not committed yet:
the end offsets minus the group's committed offsets (minus the start offsets where the
group has not committed). Buffered jobs count, since they are not committed either.
Utilisation = tokens reserved in the ledger / the fleet's capacity (live heartbeats).

A reading that failed keeps the last one; one older than `STALE_S` is not used (the
API then refuses nothing for load: the scheduler's own backpressure still holds).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import redis
from kafka import KafkaAdminClient, TopicPartition
from kafka.admin import OffsetSpec
from kafka.errors import KafkaError

from kvfleet.capacity import FleetCapacity
from kvfleet.contracts import Priority
from kvfleet.ledger import Ledger
from kvfleet.settings import KafkaSettings

log = logging.getLogger("kvfleet.api")

#: Readings older than this are ignored: ten missed refreshes means Kafka or Redis is
#: unreachable, and a guess is worse than no load shedding.
STALE_S = 10.0


@dataclass(frozen=True)
class Reading:
    at: float = 0.0  # monotonic seconds; 0 = never read
    backlog: dict[Priority, int] = field(default_factory=dict)
    #: Messages committed per second since the previous reading, per class.
    drain_per_s: dict[Priority, float] = field(default_factory=dict)
    utilization: float = 0.0


class Pressure:
    def __init__(self, kafka: KafkaSettings, ledger: Ledger, capacity: FleetCapacity, *,
                 every_s: float = 1.0) -> None:
        self.kafka = kafka
        self.ledger = ledger
        self.capacity = capacity
        self.every_s = every_s
        self.reading = Reading()  # replaced whole, so readers never see half a refresh
        self._committed: dict[Priority, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pressure", daemon=True)
        self._admin: Optional[KafkaAdminClient] = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._admin is not None:
            self._admin.close()

    def current(self) -> Optional[Reading]:
        """The latest reading, or None when there is none fresh enough to act on."""
        reading = self.reading
        return reading if reading.at and time.monotonic() - reading.at < STALE_S else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except (KafkaError, redis.RedisError, OSError) as exc:
                log.warning("load reading failed; keeping the last one", extra={"error": str(exc)})
            except Exception:  # noqa: BLE001 - the thread must outlive any bad reading
                log.exception("load reading failed unexpectedly; keeping the last one")
            self._stop.wait(self.every_s)

    def refresh(self) -> None:
        previous, now = self.reading, time.monotonic()
        committed, backlog = self._lag()
        elapsed = now - previous.at if previous.at else 0.0
        drain = {p: (committed[p] - self._committed.get(p, committed[p])) / elapsed if elapsed else 0.0
                 for p in Priority}
        self._committed = committed
        capacity = self.capacity.read()
        used = self.ledger.in_use()
        self.reading = Reading(now, backlog, drain, used / capacity if capacity else (1.0 if used else 0.0))

    def _lag(self) -> tuple[dict[Priority, int], dict[Priority, int]]:
        """Per class: the group's committed offsets summed, and the backlog."""
        if self._admin is None:
            self._admin = KafkaAdminClient(**self.kafka.client_options, client_id="kvfleet-api-lag")
        admin = self._admin
        partitions = [TopicPartition(t["name"], p["partition_index"])
                      for t in admin.describe_topics(self.kafka.topics) for p in t["partitions"]]
        group = admin.list_group_offsets(self.kafka.group).get(self.kafka.group, {})
        ends = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in partitions})
        # Where the group never committed, it starts from the earliest offset kept.
        uncommitted = [tp for tp in partitions if tp not in group or group[tp].offset < 0]
        starts = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in uncommitted}) if uncommitted else {}
        committed = {p: 0 for p in Priority}
        backlog = {p: 0 for p in Priority}
        priority_of = dict(zip(self.kafka.topics, Priority))
        for tp in partitions:
            position = starts[tp].offset if tp in starts else group[tp].offset
            committed[priority_of[tp.topic]] += position
            backlog[priority_of[tp.topic]] += max(0, ends[tp].offset - position)
        return committed, backlog
