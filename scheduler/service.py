"""`kvfleet-scheduler`: consumes the priority topics and dispatches jobs to the workers.

The loop, top to bottom: poll a batch → order it high, normal, low → for each record,
decode (or dead-letter) and admit → commit the batch's offsets. Offsets are committed
only after every job in the batch is durably admitted (state in Redis, task in the
broker) or dead-lettered; a crash before the commit redelivers the batch, and admission
is idempotent by job id, so nothing is lost and nothing runs twice.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Iterable, Optional

import redis
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from kvfleet import logs
from kvfleet.contracts import Priority
from kvfleet.jobstore import JobStore
from kvfleet.kafka import ensure_topics, make_consumer, make_producer
from kvfleet.settings import Settings
from scheduler.dispatch import Dispatcher
from scheduler.intake import Rejected, decode_record, dlq_headers, job_id_hint
from workers.celery_app import make_celery

log = logging.getLogger("kvfleet.scheduler")

CONSUMED = Counter("kvfleet_scheduler_records_consumed", "Kafka records read", ["priority"])
OUTCOMES = Counter("kvfleet_scheduler_jobs", "Jobs by admission outcome", ["priority", "outcome"])
DEAD = Counter("kvfleet_scheduler_dead_lettered", "Records sent to the dead-letter topic", ["reason"])
QUEUE_DELAY = Histogram("kvfleet_scheduler_queue_delay_seconds", "Submission to dispatch", ["priority"],
                        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
LAG = Gauge("kvfleet_scheduler_consumer_lag_messages", "Messages not yet consumed", ["priority"])
RETRIES = Counter("kvfleet_scheduler_batch_retries", "Batches re-read after a dispatch failure")


class SchedulerService:
    def __init__(self, settings: Settings, consumer: KafkaConsumer, dlq_producer: KafkaProducer,
                 dispatcher: Dispatcher) -> None:
        self.settings = settings
        self.consumer = consumer
        self.dlq = dlq_producer
        self.dispatcher = dispatcher
        self.stopping = threading.Event()
        self._priority_of = {t: p for t, p in zip(settings.kafka.topics, Priority)}
        self._last_lag = 0.0

    def run(self) -> None:
        self.wait_for_topics()
        self.consumer.subscribe(self.settings.kafka.topics)
        log.info("scheduler consuming", extra={"topics": self.settings.kafka.topics, "group": self.settings.kafka.group})
        while not self.stopping.is_set():
            batch = self.poll()
            if batch:
                self.process(batch)
            self.update_lag()
        log.info("scheduler stopping: stop requested")

    def wait_for_topics(self, timeout_s: float = 60.0) -> None:
        """Join the group only once this client has metadata for every topic: a member
        that joins while a just-created topic has no metadata yet is assigned none of its
        partitions, and only a later metadata refresh would fix that."""
        deadline = time.monotonic() + timeout_s
        while not all(self.consumer.partitions_for_topic(t) for t in self.settings.kafka.topics):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Kafka metadata for {self.settings.kafka.topics} after {timeout_s:.0f}s")
            time.sleep(0.2)

    def poll(self) -> list[ConsumerRecord]:
        polled = self.consumer.poll(timeout_ms=self.settings.scheduler.poll_timeout_ms,
                                    max_records=self.settings.scheduler.max_poll_records)
        records = [r for rs in polled.values() for r in rs]
        # High first; within a class, Kafka order (per partition) is kept by the stable sort.
        records.sort(key=lambda r: self._priority_of[r.topic].rank)
        return records

    def process(self, records: list[ConsumerRecord]) -> None:
        try:
            for record in records:
                self.handle(record)
            self.dlq.flush(timeout=10)
            self.consumer.commit()
        except (redis.RedisError, KafkaError, OSError) as exc:
            # Nothing of this batch is committed: rewind to its first offsets and retry.
            # Records already admitted will be found admitted and re-sent, harmlessly.
            RETRIES.inc()
            log.error("batch failed; re-reading it", extra={"error": f"{type(exc).__name__}: {exc}"})
            self.rewind(records)
            time.sleep(1.0)

    def handle(self, record: ConsumerRecord) -> None:
        priority = self._priority_of[record.topic]
        CONSUMED.labels(priority.value).inc()
        try:
            job = decode_record(record, priority)
        except Rejected as rejected:
            self.dead_letter(record, rejected)
            return
        now = time.time()
        admission = self.dispatcher.admit(job, now=now)
        OUTCOMES.labels(priority.value, admission.outcome).inc()
        if admission.outcome == "dispatched":
            QUEUE_DELAY.labels(priority.value).observe(max(0.0, now - job.submitted_at))
        log.info(admission.outcome, extra={"job_id": job.job_id, "priority": priority.value, "tenant": job.tenant})

    def dead_letter(self, record: ConsumerRecord, rejected: Rejected) -> None:
        job_id = job_id_hint(record)
        self.dlq.send(self.settings.kafka.dlq, key=record.key, value=record.value or b"",
                      headers=dlq_headers(record, rejected, job_id))
        DEAD.labels(rejected.reason).inc()
        log.warning("dead-lettered", extra={"job_id": job_id, "reason": rejected.reason, "detail": rejected.detail,
                                            "topic": record.topic, "offset": record.offset})

    def rewind(self, records: Iterable[ConsumerRecord]) -> None:
        first: dict[TopicPartition, int] = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            first[tp] = min(first.get(tp, r.offset), r.offset)
        for tp, offset in first.items():
            self.consumer.seek(tp, offset)

    def update_lag(self, every_s: float = 5.0) -> None:
        if time.monotonic() - self._last_lag < every_s:
            return
        self._last_lag = time.monotonic()
        assigned = self.consumer.assignment()
        if not assigned:
            return
        try:
            ends = self.consumer.end_offsets(list(assigned))
        except KafkaError:
            return
        lag = {p: 0 for p in Priority}
        for tp, end in ends.items():
            lag[self._priority_of[tp.topic]] += max(0, end - self.consumer.position(tp))
        for p, value in lag.items():
            LAG.labels(p.value).set(value)


def build(settings: Settings, *, client_id: str = "kvfleet-scheduler") -> SchedulerService:
    ensure_topics(settings.kafka)
    store = JobStore(redis.Redis.from_url(settings.redis.url), settings.redis.keys)
    dispatcher = Dispatcher(store, make_celery(settings), settings.redis.key_prefix)
    consumer = make_consumer(settings.kafka, client_id=client_id,
                             max_poll_records=settings.scheduler.max_poll_records)
    return SchedulerService(settings, consumer, make_producer(settings.kafka, client_id=f"{client_id}-dlq"), dispatcher)


def main(argv: Optional[list[str]] = None) -> None:
    settings = Settings.from_env()
    logs.setup("scheduler", settings.log_level)
    service = build(settings)
    if settings.scheduler.metrics_port:
        start_http_server(settings.scheduler.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stopping.set())
    try:
        service.run()
    finally:
        service.consumer.close()  # leaves the group at once so partitions move without waiting
        service.dlq.close(timeout=5)
        log.info("scheduler stopped")


if __name__ == "__main__":
    main()
