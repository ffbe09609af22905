"""Kafka clients configured the one way kvfleet uses them, and topic creation.

Producers (kafka-python's for the workers and tests; librdkafka's for the API's
submissions and for the scheduler's results and dead letters): `acks=all` with retries
and idempotence, so a produce that returns has been written by every in-sync replica and
a retried send does not duplicate. Consumers: manual commits only (offsets move after
admission is durable, never before).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from kvfleet import constants
from kvfleet.settings import KafkaSettings

log = logging.getLogger(__name__)


#: kafka-python backs off reconnects exponentially up to 30 s by default: after a broker
#: restart the API kept failing sends for 26 s (bench/chaos.py). A broker is one of a few
#: hosts; a retry a second is cheap and gives back service within about a second.
RECONNECT = dict(reconnect_backoff_ms=50, reconnect_backoff_max_ms=1000)

#: kafka-python's own metrics (`client.metrics()`) are not read anywhere: kvfleet's are
#: Prometheus. Recording them costs several sensor updates per record sent or fetched,
#: on the hot paths of the API's submits and the scheduler's intake and relay (issue 16).
NO_CLIENT_METRICS = dict(metrics_enabled=False)


def make_producer(kafka: KafkaSettings, *, client_id: str, linger_ms: int = 0) -> KafkaProducer:
    """`linger_ms` 0 (the default) for a producer whose callers wait on each record (the
    API); a few ms for one that sends many at once and flushes (the results relay)."""
    return KafkaProducer(
        **kafka.client_options,
        **RECONNECT,
        **NO_CLIENT_METRICS,
        client_id=client_id,
        acks="all",
        retries=10,
        enable_idempotence=True,
        # No linger for a caller that waits on each record: a linger of 2 ms made an idle
        # produce wait 4.8 ms instead of 1.3 (issue 16), and kafka-python batches what
        # arrives while a request is in flight anyway.
        linger_ms=linger_ms,
        request_timeout_ms=10_000,
        max_block_ms=10_000,  # fail fast (503) instead of hanging a request when Kafka is down
    )


#: How long librdkafka may try to deliver a submission, ms: as long as the API waits for
#: its acknowledgement (producer/publisher.py), so a job the client was told was not
#: queued is not queued later by a retry nobody waits on any more.
SUBMIT_DELIVERY_TIMEOUT_MS = 10_000


def make_submit_producer(kafka: KafkaSettings, *, client_id: str, logger: logging.Logger,
                         **overrides) -> "confluent_kafka.Producer":
    """The API's producer: librdkafka (confluent-kafka), whose produce is acknowledged in
    about half the time of kafka-python's on the same broker (1.7 against 3.3 ms p50,
    issue 16) and costs the event loop a C call, not Python batching. The same
    guarantees as `make_producer`: acks=all, idempotence, no linger. The partitioner is
    Java's (murmur2 of the key), as kafka-python's is, so a tenant's jobs go to the same
    partition whichever client queued them. `overrides`: librdkafka options, for tests."""
    import confluent_kafka  # the workers never load it

    return confluent_kafka.Producer({
        **kafka.rdkafka_options,
        "client.id": client_id,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 0,  # each caller waits on its record; what arrives meanwhile is batched anyway
        "partitioner": "murmur2_random",
        "message.timeout.ms": SUBMIT_DELIVERY_TIMEOUT_MS,
        "request.timeout.ms": SUBMIT_DELIVERY_TIMEOUT_MS,
        # As RECONNECT: a broker back from a restart is found within a second.
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 1000,
        "logger": logger,  # librdkafka's lines go to kvfleet's JSON logs, served by poll()
        **overrides,
    })


#: How long the batch producer may try to deliver a record, ms: as long as the results
#: relay waits in `deliver` (its PRODUCE_TIMEOUT_S is this).
BATCH_DELIVERY_TIMEOUT_MS = 30_000


def make_batch_producer(kafka: KafkaSettings, *, client_id: str, logger: logging.Logger,
                        linger_ms: int = 0, **overrides) -> "confluent_kafka.Producer":
    """A librdkafka producer for a thread that sends records in batches and waits for
    them all (`deliver`): the scheduler's results relay and dead letters. kafka-python's
    producer ran a sender thread of its own in the scheduler's process, in Python, beside
    the scheduling loop; librdkafka's threads are C and never hold the GIL. Reports and
    log lines are served by the caller's `flush` and `poll`, so no thread of ours serves
    them. The guarantees of `make_submit_producer`, with the wait of `deliver`."""
    return make_submit_producer(kafka, client_id=client_id, logger=logger, **{
        "linger.ms": linger_ms,
        "message.timeout.ms": BATCH_DELIVERY_TIMEOUT_MS,
        **overrides,
    })


#: One record to `deliver`: topic, key, value, headers.
Record = tuple[str, Optional[bytes], bytes, Sequence[tuple[str, bytes]]]


def deliver(producer: "confluent_kafka.Producer", records: Sequence[Record], timeout_s: float) -> list[Optional[str]]:
    """Produce `records` and wait up to `timeout_s` for Kafka's reports (the batch goes
    at once, without its linger); per record, None if Kafka acknowledged it, else why
    not. A record whose report has not come by then counts as not acknowledged: it may
    still arrive later, a copy the caller's retry makes harmless (at least once)."""
    outcomes: list[Optional[str]] = [f"not acknowledged within {timeout_s:g} s"] * len(records)

    def report(i: int):
        def on_delivery(error, _message) -> None:  # in this thread, from flush()
            outcomes[i] = None if error is None else error.str()
        return on_delivery

    import confluent_kafka

    for i, (topic, key, value, headers) in enumerate(records):
        try:
            producer.produce(topic, key=key, value=value, headers=list(headers), on_delivery=report(i))
        except BufferError:
            outcomes[i] = "the producer's queue is full"
        except confluent_kafka.KafkaException as exc:
            outcomes[i] = str(exc)
    producer.flush(timeout_s)
    return outcomes


class DeliveryFailed(Exception):
    """Kafka did not acknowledge a record `deliver` sent; nothing was taken for done."""


def make_consumer(kafka: KafkaSettings, *, client_id: str, max_poll_records: int,
                  fetch_max_wait_ms: int) -> KafkaConsumer:
    """`fetch_max_wait_ms`: how long the broker may hold a fetch that found nothing
    (SchedulerSettings.fetch_max_wait_ms says why the scheduler's is short)."""
    return KafkaConsumer(
        **kafka.client_options,
        **RECONNECT,
        **NO_CLIENT_METRICS,
        group_id=kafka.group,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",  # a new group must not skip jobs already queued
        max_poll_records=max_poll_records,
        fetch_max_wait_ms=fetch_max_wait_ms,
        # A poll batch is dispatched in milliseconds; 5 min is the ceiling before the
        # group considers this replica stuck and hands its partitions to another.
        max_poll_interval_ms=300_000,
        session_timeout_ms=10_000,
        heartbeat_interval_ms=3_000,
    )


def release_parked(consumer: KafkaConsumer) -> set[TopicPartition]:
    """Let go of the records kafka-python parked for partitions no longer paused, so they
    are fetched again from their position (the first record not yet taken); the partitions
    let go of.

    kafka-python 3.0.12 parks the fetched records of a partition paused before they were
    all taken (`Fetcher.fetched_records`, consumer/fetcher.py 608-611) and gives them back
    after a resume only while its in-line slot `_next_partition_records` is None
    (fetcher.py 589). The slot keeps the last batch it used up, empty but not None, and
    goes back to None only when it parks again; and a partition with parked records is
    never fetched (`_fetchable_partitions`, fetcher.py 1234). So a resumed partition stayed
    behind its end for good. A seek does not help: nothing clears the parked entry.
    Dropping it is safe: the position never passed a record that was not returned.
    Private API, hence the guards: a client without it goes without the release."""
    parked = getattr(getattr(consumer, "_fetcher", None), "_paused_partition_records", None)
    if not parked:
        return set()
    paused = consumer.paused()
    released = {tp for tp in list(parked) if tp not in paused}
    for tp in released:
        parked.pop(tp).drain()
    return released


def make_admin(kafka: KafkaSettings, *, client_id: str) -> KafkaAdminClient:
    return KafkaAdminClient(**kafka.client_options, **RECONNECT, client_id=client_id)


def ensure_topics(kafka: KafkaSettings) -> None:
    """Create the three priority topics, the dead-letter topic and the results topic if
    missing. Results are keyed by job id, spread over as many partitions as a request
    topic, and kept a week (`RESULTS_RETENTION_MS`) whatever the broker's default."""
    admin = make_admin(kafka, client_id="kvfleet-admin")
    try:
        existing = set(admin.list_topics())
        wanted = [NewTopic(t, kafka.partitions, 1) for t in kafka.topics if t not in existing]
        if kafka.dlq not in existing:
            wanted.append(NewTopic(kafka.dlq, constants.DLQ_PARTITIONS, 1))
        if kafka.results not in existing:
            wanted.append(NewTopic(kafka.results, kafka.partitions, 1,
                                   topic_configs={"retention.ms": str(constants.RESULTS_RETENTION_MS)}))
        if not wanted:
            return
        try:
            admin.create_topics(wanted)
        except TopicAlreadyExistsError:
            pass  # another service created them between our list and create
        log.info("created topics %s", [t.name for t in wanted])
    finally:
        admin.close()
