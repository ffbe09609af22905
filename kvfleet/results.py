"""Results on Kafka: the relay that produces every terminal JobResult, keyed by job id,
to the job's `reply_to` topic or to `<topic prefix>.results`, at least once.

The job store's `finish` appends each result to a Redis Stream, the outbox
(`Keys.results_outbox`), in the same Lua call that writes it (kvfleet/jobstore.py): a
result that exists is queued for Kafka, even if its writer dies the next instant. The
relay drains the outbox: read entries through a consumer group, produce each one
(acks=all, librdkafka: `kvfleet.kafka.make_batch_producer`), wait for the acks, then
XACK and XDEL it. Every scheduler replica runs one
(scheduler/service.py), in its own thread, sharing the work through the group.

At least once, never a different result. Each race, and why it is safe:
- Two relays read at once: the consumer group gives each entry to one of them.
- A relay dies between its produce and its XACK: the entry stays pending under its
  name; once idle `CLAIM_IDLE_MS`, another relay's XAUTOCLAIM takes it and produces it
  again. The entry holds the result's bytes as they were written, and a terminal job
  is never written twice, so the copy is byte for byte the same message.
- A live relay waits on a slow ack past the claim idle time: both produce the same
  bytes, both XACK (the second acknowledges nothing) and XDEL (a no-op the second time).
- Kafka refuses or times out: the entries stay pending under this relay, which reads
  its own pending entries first on its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import redis
from prometheus_client import Counter, Gauge

from kvfleet import constants
from kvfleet.constants import Keys
from kvfleet.kafka import BATCH_DELIVERY_TIMEOUT_MS, DeliveryFailed, deliver

log = logging.getLogger("kvfleet.results")

#: An entry pending this long belongs to a relay that died: well past the longest a live
#: relay holds one (its batch's acks may take up to PRODUCE_TIMEOUT_S).
CLAIM_IDLE_MS = 60_000
CLAIM_EVERY_S = 5.0
#: As long as the producer tries a record (`make_batch_producer`).
PRODUCE_TIMEOUT_S = BATCH_DELIVERY_TIMEOUT_MS / 1000
#: Entries per read: one produce round for a burst of finishing jobs.
BATCH = 200
#: How long a read waits for new results: a result reaches Kafka milliseconds after its
#: job ends, and a stop is noticed within this.
BLOCK_MS = 500
OBSERVE_EVERY_S = 1.0
_FAILURES = (redis.RedisError, DeliveryFailed, OSError)

PRODUCED = Counter("kvfleet_results_produced", "Terminal results produced to Kafka and acknowledged; "
                   "topic_kind: results (the default topic), reply_to, fallback (a reply_to that "
                   "could not be used: the default topic, with headers saying why)", ["topic_kind"])
OUTBOX = Gauge("kvfleet_results_outbox_entries", "Terminal results written but not yet acknowledged by Kafka")


@dataclass(frozen=True)
class OutboxEntry:
    """One outbox entry: a terminal result waiting for Kafka."""

    id: bytes  # the stream entry id
    job_id: str
    status: str  # the terminal state, also in `result`; a header, so readers may filter undecoded
    reply_to: str  # '' when the job named none
    result: bytes  # the JobResult JSON exactly as the job store wrote it: what is produced

    @classmethod
    def from_stream(cls, entry_id: bytes, fields: Mapping[bytes, bytes]) -> "OutboxEntry":
        return cls(entry_id, fields[b"job_id"].decode(), fields[b"status"].decode(),
                   fields[b"reply_to"].decode(), fields[b"result"])


class KnownTopics:
    """Which topics the broker has, so that a result is never sent to a topic that does
    not exist: with auto-creation off (kvfleet's broker), such a send would block for
    the producer's max_block_ms and then fail, again on every retry. The broker's topic
    list is read again on a miss, at most once per `refresh_s`."""

    def __init__(self, list_topics: Callable[[], Iterable[str]], *, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, close: Callable[[], None] = lambda: None) -> None:
        """`list_topics`: the broker's topic names (an admin client's); `close` frees it."""
        self.list_topics = list_topics
        self.close = close
        self.refresh_s = refresh_s
        self.clock = clock
        self._topics: frozenset[str] = frozenset()
        self._next_refresh = 0.0

    def __contains__(self, topic: str) -> bool:
        if topic not in self._topics and self.clock() >= self._next_refresh:
            self._topics = frozenset(self.list_topics())
            self._next_refresh = self.clock() + self.refresh_s
        return topic in self._topics


class ResultRelay:
    """Drains the results outbox to Kafka; `run` is a thread's loop, `step` one batch."""

    def __init__(self, client: redis.Redis, keys: Keys, producer: "confluent_kafka.Producer", topics: KnownTopics, *,
                 results_topic: str, reserved_topics: Iterable[str], consumer: str,
                 claim_idle_ms: int = CLAIM_IDLE_MS, batch: int = BATCH, gather_s: float = 0.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`producer`: `kvfleet.kafka.make_batch_producer`'s, used by this relay alone.
        `reserved_topics`: kvfleet's own request and dead-letter topics, never a reply
        topic (a result there would be dead-lettered as a malformed job). `consumer`:
        this relay's name in the group, unique per process. `gather_s`: the least time
        between two batches while results keep coming (`step`), waited with `sleep`."""
        self.client = client
        self.outbox = keys.results_outbox
        self.producer = producer
        self.topics = topics
        self.results_topic = results_topic
        self.reserved = frozenset(reserved_topics)
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.batch = batch
        self.gather_s = gather_s
        self.sleep = sleep
        self._relayed_at = float("-inf")  # when the last batch with entries was acknowledged
        self._own_pending = True  # read this relay's pending entries before new ones
        self._claim_from = "0-0"  # XAUTOCLAIM's cursor through the group's pending entries
        self._next_claim = self._next_observe = 0.0

    def run(self, stopping: threading.Event) -> None:
        log.info("results relay running", extra={"outbox": self.outbox, "consumer": self.consumer})
        while not stopping.is_set():
            try:
                self.step(block_ms=BLOCK_MS)
                self.observe()
            except _FAILURES as exc:
                # Nothing was acknowledged that Kafka did not take: retry.
                log.error("results relay step failed; retrying in 1 s", extra={"error": f"{type(exc).__name__}: {exc}"})
                stopping.wait(1.0)
        log.info("results relay stopping: stop requested")

    def step(self, *, block_ms: int = 0) -> int:
        """Relay one batch: entries a dead relay left, else this relay's own, else new
        ones (waiting up to `block_ms` for them). Returns how many were produced.

        A step that follows a batch by less than `gather_s` first waits out the rest of
        it. Under load, jobs end an engine step at a time, and each of their results
        alone cost a produce request and an acknowledgement of its own: a Kafka
        request and two Redis round trips per 128-token job (issue 16). A result
        that finds the relay idle is read and sent at once."""
        wait = self._relayed_at + self.gather_s - time.monotonic()
        if wait > 0:
            self.sleep(wait)
        entries = self.claim() or self.read(block_ms)
        if not entries:
            return 0
        relayed = self.relay(entries)
        self._relayed_at = time.monotonic()
        return relayed

    def ensure_group(self) -> None:
        try:
            # From the stream's start: every entry still in it is unrelayed (relayed ones
            # are deleted), so a group created late, or again after the stream expired
            # with it, loses nothing.
            self.client.xgroup_create(self.outbox, constants.RESULTS_RELAY_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # another relay created it first
                raise

    def claim(self) -> list[OutboxEntry]:
        """Take over entries another relay read but never acknowledged (it died)."""
        if time.monotonic() < self._next_claim:
            return []
        try:
            cursor, claimed, *_ = self.client.xautoclaim(
                self.outbox, constants.RESULTS_RELAY_GROUP, self.consumer, self.claim_idle_ms,
                start_id=self._claim_from, count=self.batch)
        except redis.ResponseError as exc:
            return self._missing_group(exc)
        self._claim_from = cursor
        # More pending entries behind the cursor: claim again next step, else after a pause.
        self._next_claim = 0.0 if cursor not in (b"0-0", "0-0") else time.monotonic() + CLAIM_EVERY_S
        if claimed:
            log.warning("claimed results a dead relay left unacknowledged", extra={"count": len(claimed)})
        return self._entries(claimed)

    def read(self, block_ms: int) -> list[OutboxEntry]:
        if self._own_pending:
            entries = self._read("0", None)  # "0": this consumer's own pending entries
            if entries:
                return entries
            self._own_pending = False
        return self._read(">", block_ms or None)  # redis-py: block=0 would wait forever

    def _read(self, stream_id: str, block_ms: Optional[int]) -> list[OutboxEntry]:
        try:
            reply = self.client.xreadgroup(constants.RESULTS_RELAY_GROUP, self.consumer, {self.outbox: stream_id},
                                           count=self.batch, block=block_ms)
        except redis.ResponseError as exc:
            return self._missing_group(exc)
        return self._entries(reply[0][1]) if reply else []

    def _missing_group(self, exc: redis.ResponseError) -> list[OutboxEntry]:
        """No group: the first run, or the outbox expired with its group (kvfleet/jobstore.py)."""
        if "NOGROUP" not in str(exc):
            raise exc
        self.ensure_group()
        return []

    def _entries(self, raw: list) -> list[OutboxEntry]:
        """Decoded entries; those deleted while pending (fields None) are acknowledged away."""
        gone = [entry_id for entry_id, fields in raw if entry_id is not None and not fields]
        if gone:
            self.ack(gone)
        return [OutboxEntry.from_stream(entry_id, fields) for entry_id, fields in raw if fields]

    def relay(self, entries: list[OutboxEntry]) -> int:
        """Produce every entry, wait for Kafka's acks, acknowledge those it took."""
        try:
            routes = [self.route(entry) for entry in entries]
            outcomes = deliver(self.producer, [(topic, entry.job_id.encode(), entry.result, headers)
                                               for entry, (topic, _, headers) in zip(entries, routes)],
                               PRODUCE_TIMEOUT_S)
            done, failed = [], []
            for entry, (_, kind, _), outcome in zip(entries, routes, outcomes):
                if outcome is None:
                    done.append(entry.id)
                    PRODUCED.labels(kind).inc()
                else:
                    failed.append((entry.job_id, outcome))
            self.ack(done)  # a crash before this line produces them again: the same bytes
        except BaseException:
            self._own_pending = True  # what was not acknowledged is retried first
            raise
        if failed:
            self._own_pending = True
            raise DeliveryFailed(f"Kafka did not acknowledge {len(failed)} of {len(entries)} results "
                                 f"(job {failed[0][0]}: {failed[0][1]})")
        return len(done)

    def route(self, entry: OutboxEntry) -> tuple[str, str, list[tuple[str, bytes]]]:
        """(topic, topic kind, headers) of one result."""
        job_id = entry.job_id.encode()
        headers = [(name, job_id) for name in constants.CORRELATION_HEADERS]
        headers += [("job_id", job_id), ("status", entry.status.encode())]
        if not entry.reply_to:
            return self.results_topic, "results", headers
        if entry.reply_to in self.reserved:
            problem = "reserved_topic"
        elif entry.reply_to not in self.topics:
            problem = "unknown_topic"
        else:
            return entry.reply_to, "reply_to", headers
        # Never lost: the default topic takes it, with the topic it was meant for and why.
        log.warning("reply_to topic unusable; producing to the results topic",
                    extra={"job_id": entry.job_id, "reply_to": entry.reply_to, "reason": problem})
        return self.results_topic, "fallback", headers + [("reply_to", entry.reply_to.encode()),
                                                          ("reply_to_error", problem.encode())]

    def ack(self, entry_ids: list[bytes]) -> None:
        """Acknowledge and delete together: the group alone never shrinks the stream, and
        a deleted entry must not stay pending."""
        if not entry_ids:
            return
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.outbox, constants.RESULTS_RELAY_GROUP, *entry_ids)
            pipe.xdel(self.outbox, *entry_ids)
            pipe.execute()

    def observe(self) -> None:
        if time.monotonic() < self._next_observe:
            return
        self._next_observe = time.monotonic() + OBSERVE_EVERY_S
        OUTBOX.set(self.client.xlen(self.outbox))  # relayed entries are deleted: the rest waits
        self.producer.poll(0)  # librdkafka's log lines, between batches too

    def close(self, timeout: float = 5.0) -> None:
        self.producer.flush(timeout)
        self.topics.close()
