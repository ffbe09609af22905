"""How far each partition's offset may be committed, when jobs leave out of Kafka order;
and which partitions a rebalance took away.

The policy admits by priority, age and fit, not by offset, so a partition can hold an
undecided record (buffered, waiting for budget) before decided ones. Its committed
offset may advance only to that oldest undecided record: committing past it would lose
the record if this replica crashed. Committing less is always safe: a redelivered
record whose job was already decided is recognised by its state and skipped.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from kafka import TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.structs import OffsetAndMetadata


class OffsetBook:
    def __init__(self) -> None:
        self._undecided: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}  # one past the last record read
        self._committed: dict[TopicPartition, int] = {}

    def read(self, tp: TopicPartition, offset: int) -> None:
        """A record was polled; it is undecided until `decided()`."""
        self._undecided.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def decided(self, tp: TopicPartition, offset: int) -> None:
        """The record's job is durably admitted, refused or dead-lettered."""
        undecided = self._undecided.get(tp)
        if undecided is not None:
            undecided.discard(offset)

    def position(self, tp: TopicPartition) -> Optional[int]:
        """Where the partition's commit may go: its oldest undecided record, else one past
        the last record read; None if nothing was read from it."""
        if tp not in self._next:
            return None
        undecided = self._undecided.get(tp)
        return min(undecided) if undecided else self._next[tp]

    def due(self) -> dict[TopicPartition, OffsetAndMetadata]:
        """Commit positions that moved since the last commit."""
        due = {}
        for tp in self._next:
            position = self.position(tp)
            if position > self._committed.get(tp, -1):
                due[tp] = OffsetAndMetadata(position, "", -1)
        return due

    def committed(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        for tp, meta in offsets.items():
            self._committed[tp] = meta.offset

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Partitions revoked: their next owner reads them again from their committed
        offsets (this member too, once the loop has sought them back to `position()`)."""
        for tp in partitions:
            self._undecided.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)


class Revocations(ConsumerRebalanceListener):
    """Which partitions a rebalance took away, and whether the member is still waiting
    for its next assignment.

    kafka-python 3 runs these callbacks on its IO thread (while `poll()` or `close()`
    waits on it, and heartbeats wait on it too), so they only take notes; the loop drops
    the revoked partitions' buffered jobs right after the poll returns, before it reads
    any record.

    `on_revoke` runs first thing in each revocation. The scheduler passes a call that
    pins the coordinator's `rejoin_needed` flag (see `SchedulerService.pin_rejoin`):
    kafka-python 3.0.12 loses a rebalance's assignment when the poll that started it
    times out before the SyncGroup answer and the rebalance was triggered by a metadata
    change rather than by that flag. Measured here: a scheduler subscribing to topics
    created a moment before was revoked 0.6 s later and never assigned again.
    """

    def __init__(self, on_revoke: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._revoked: set[TopicPartition] = set()
        self._on_revoke = on_revoke
        self._clock = clock
        self._waiting_since: Optional[float] = clock()  # subscribed, not yet assigned

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._on_revoke()
        with self._lock:
            self._revoked |= set(revoked)
            if self._waiting_since is None:
                self._waiting_since = self._clock()

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # A new partition is read from its committed offset; one given back to this member
        # keeps kafka-python's position, which the loop seeks back after the poll
        # (`SchedulerService.forget_revoked`): nothing to set up here. An empty
        # assignment counts too: a group with more members than partitions is healthy.
        with self._lock:
            self._waiting_since = None

    def take(self) -> set[TopicPartition]:
        with self._lock:
            taken, self._revoked = self._revoked, set()
        return taken

    def unassigned_for(self) -> float:
        """Seconds since this member started waiting for an assignment (0 when it has one)."""
        with self._lock:
            return 0.0 if self._waiting_since is None else self._clock() - self._waiting_since

    def restart(self) -> None:
        """The member rejoins from scratch (re-subscribed): wait afresh."""
        with self._lock:
            self._waiting_since = self._clock()
