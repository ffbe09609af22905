"""Puts validated jobs onto the priority topics: record state first, then produce.

Order matters. The job's state is written to Redis as `queued` *before* the message is
produced, so a scheduler that reads the message always finds the job. If the produce
then fails, the job is marked `failed` (code `enqueue_failed`) so its state stays true:
a client polling it learns it will never run instead of waiting forever.
"""

from __future__ import annotations

import logging
import threading

from kafka.errors import KafkaError

from kvfleet import constants
from kvfleet.contracts import JobRequest, JobState, encode
from kvfleet.jobstore import JobStore
from kvfleet.kafka import make_producer
from kvfleet.logs import now
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, kafka: KafkaSettings, store: JobStore, *, client_id: str = "kvfleet-api") -> None:
        self.kafka = kafka
        self.store = store
        self._client_id = client_id
        self._producer = None
        self._lock = threading.Lock()  # the producer is created on first use, once

    @property
    def producer(self):
        with self._lock:
            if self._producer is None:
                self._producer = make_producer(self.kafka, client_id=self._client_id)
            return self._producer

    def publish(self, request: JobRequest, *, timeout_s: float = 10.0) -> None:
        """Produce with acks=all and wait for the broker's acknowledgement."""
        topic = constants.request_topic(self.kafka.topic_prefix, request.priority)
        try:
            future = self.producer.send(
                topic,
                key=request.tenant.encode(),  # one tenant's jobs stay ordered in one partition
                value=encode(request),
                headers=[("job_id", request.job_id.encode()), ("v", str(request.v).encode())],
            )
            meta = future.get(timeout=timeout_s)
        except (KafkaError, OSError) as exc:
            self.store.fail(request.job_id, JobState.FAILED, "enqueue_failed",
                            f"Kafka did not accept the job ({type(exc).__name__}: {exc}); submit it again", now=now())
            log.error("produce failed", extra={"job_id": request.job_id, "error": str(exc)})
            raise QueueUnavailable(f"the queue is unavailable ({exc}); nothing will run, retry later",
                                   job_id=request.job_id) from exc
        log.info("queued", extra={"job_id": request.job_id, "topic": topic, "partition": meta.partition,
                                  "offset": meta.offset, "tenant": request.tenant})

    def ready(self) -> bool:
        """Kafka reachable: the producer has metadata for the request topics."""
        try:
            return all(self.producer.partitions_for(t) for t in self.kafka.topics)
        except (KafkaError, OSError):
            return False

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close(timeout=5)
                self._producer = None
