"""Puts validated jobs onto the priority topics (acks=all), before anything is recorded.

Kafka is the record of a job; its Redis state follows. The API produces first and
records `queued` after (`producer/submission.py`), so there is no window in which a
job sits `queued` that Kafka never received (a crash between the two only leaves the
job on Kafka, and the scheduler records a job it finds without a state). If the
produce fails nothing is recorded: the client's `503` means "nothing was queued", and a
retry with the same `job_id` simply submits it again. A produce whose outcome is
unknown (a timeout after the broker wrote it) may leave a copy on Kafka too; the retry
then produces a second one, which the scheduler recognises by its id and skips.

A produce holds no thread while it waits: kafka-python's `send` only appends the
record to a batch (its sender thread does the network), and the broker's
acknowledgement comes back to the event loop through the future's callbacks
(`_acknowledged`). Only a send that could block — the producer not made yet, or no
metadata for the topic yet, where `send` waits up to `max_block_ms` — runs on a worker
thread, which happens once per topic and process, or while Kafka is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import anyio
from kafka.errors import KafkaError
from kafka.future import Future as KafkaFuture

from kvfleet import constants
from kvfleet.contracts import JobRequest, encode
from kvfleet.kafka import make_producer
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable

log = logging.getLogger(__name__)

#: Seconds a submission waits for the broker's acknowledgement before answering 503
#: (the producer's own request timeout is as long; its delivery timeout is minutes).
ACK_TIMEOUT_S = 10.0


class Publisher:
    def __init__(self, kafka: KafkaSettings, *, client_id: str = "kvfleet-api") -> None:
        self.kafka = kafka
        self._client_id = client_id
        self._producer = None
        self._lock = threading.Lock()  # the producer is created on first use, once

    @property
    def producer(self):
        """The producer, made on first use (blocking: connects to the cluster)."""
        with self._lock:
            if self._producer is None:
                self._producer = make_producer(self.kafka, client_id=self._client_id)
            return self._producer

    async def publish(self, request: JobRequest, *, timeout_s: float = ACK_TIMEOUT_S) -> bytes:
        """Produce with acks=all and wait for the broker's acknowledgement; the record's
        bytes (what the job store records). Raises QueueUnavailable: nothing was queued."""
        topic = constants.request_topic(self.kafka.topic_prefix, request.priority)
        value = encode(request)
        record = {"key": request.tenant.encode(),  # one tenant's jobs stay ordered in one partition
                  "value": value,
                  "headers": [("job_id", request.job_id.encode()), ("v", str(request.v).encode())]}
        try:
            producer = self._producer
            if producer is not None and _has_metadata(producer, topic):
                future = producer.send(topic, **record)  # appends to a batch: never waits
            else:
                future = await anyio.to_thread.run_sync(lambda: self.producer.send(topic, **record))
            meta = await _acknowledged(future, timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            log.error("produce failed", extra={"job_id": request.job_id, "error": str(exc)})
            raise QueueUnavailable(f"the queue is unavailable ({exc}); nothing was queued: retry later with "
                                   "the same job_id",
                                   job_id=request.job_id) from exc
        log.info("queued", extra={"job_id": request.job_id, "topic": topic, "partition": meta.partition,
                                  "offset": meta.offset, "tenant": request.tenant})
        return value

    def ready(self) -> bool:
        """Kafka reachable: the producer has metadata for the request topics (blocking)."""
        try:
            return all(self.producer.partitions_for(t) for t in self.kafka.topics)
        except (KafkaError, OSError):
            return False

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close(timeout=5)
                self._producer = None


def _has_metadata(producer, topic: str) -> bool:
    """Whether `send` to `topic` would go straight to the batch, the very test `send`
    makes before it waits on metadata (kafka-python keeps the cluster's metadata in
    `_metadata`; without it, assume it would wait)."""
    metadata = getattr(producer, "_metadata", None)
    return metadata is not None and metadata.partitions_for_topic(topic) is not None


def _acknowledged(future: KafkaFuture, timeout_s: float) -> asyncio.Future:
    """An asyncio future for a kafka-python one, settled on the event loop, or failed with
    TimeoutError after `timeout_s`. kafka-python settles its futures on the producer's
    sender thread (or at once, if settled already), so the outcome crosses to the loop
    with call_soon_threadsafe; whichever of the outcome and the timer comes first wins."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(outcome: object) -> None:  # on the loop
        if done.done():
            return  # the timer fired first: the client got its 503 already
        timer.cancel()
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)

    def expire() -> None:  # on the loop
        if not done.done():
            done.set_exception(TimeoutError(f"no acknowledgement from Kafka within {timeout_s:g} s"))

    def cross(outcome: object) -> None:  # on the sender thread
        loop.call_soon_threadsafe(settle, outcome)

    timer = loop.call_later(timeout_s, expire)
    future.add_callback(cross)
    future.add_errback(cross)
    return done
