"""Puts validated jobs onto the priority topics (acks=all), before anything is recorded.

Kafka is the record of a job; its Redis state follows. The API produces first and
records `queued` after (`producer/routes/jobs.py`), so there is no window in which a
job sits `queued` that Kafka never received (a crash between the two only leaves the
job on Kafka, and the scheduler records a job it finds without a state). If the
produce fails nothing is recorded: the client's `503` means "nothing was queued", and a
retry with the same `job_id` simply submits it again. A produce whose outcome is
unknown (a timeout after the broker wrote it) may leave a copy on Kafka too; the retry
then produces a second one, which the scheduler recognises by its id and skips.
"""

from __future__ import annotations

import logging
import threading

from kafka.errors import KafkaError

from kvfleet import constants
from kvfleet.contracts import JobRequest, encode
from kvfleet.kafka import make_producer
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, kafka: KafkaSettings, *, client_id: str = "kvfleet-api") -> None:
        self.kafka = kafka
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
            log.error("produce failed", extra={"job_id": request.job_id, "error": str(exc)})
            raise QueueUnavailable(f"the queue is unavailable ({exc}); nothing was queued: retry later with "
                                   "the same job_id",
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
