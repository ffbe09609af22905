"""The scheduler's use of kafka-python's consumer through the real Kafka and Redis: a
rebalance that gives a partition back to the same member, and a partition paused while
the consumer still held fetched records for it. Both once left jobs `queued` forever.

The scheduler runs in this process (`scheduler.service.build`, the production wiring)
and the test drives its loop step by step, so each scenario is built on purpose, not by
timing luck. No workers: a published heartbeat is the budget, and an admitted job's
Celery task stays in its queue, where the test counts it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable, Iterator

import pytest
from kafka import KafkaAdminClient, TopicPartition

from kvfleet import registry
from kvfleet.constants import celery_queue
from kvfleet.contracts import JobRequest, Priority, WorkerHeartbeat, encode
from kvfleet.kafka import ensure_topics, make_consumer, make_producer
from kvfleet.ledger import Ledger
from kvfleet.settings import KafkaSettings, RedisSettings, SchedulerSettings, Settings
from scheduler.service import SchedulerService, build

COST = 10  # tokens each job reserves: 8 prompt tokens + 2 new ones


@pytest.fixture
def scheduler(kafka_bootstrap, redis_url, prefix) -> Iterator[Callable[..., SchedulerService]]:
    """`scheduler(max_buffered=..., max_poll_records=...)`: a scheduler subscribed to
    fresh topics (one partition each), not yet polled; closed at teardown."""
    services: list[SchedulerService] = []

    def make(**policy) -> SchedulerService:
        settings = Settings()
        settings = settings.replace(
            kafka=KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=f"{prefix}.requests",
                                group=f"{prefix}-scheduler", partitions=1),
            redis=RedisSettings(url=redis_url, key_prefix=prefix),
            scheduler=SchedulerSettings(max_poll_records=policy.pop("max_poll_records", 500)),
            policy=settings.policy.replace(**policy))
        ensure_topics(settings.kafka)
        service = build(settings, client_id=f"{prefix}-scheduler")
        services.append(service)
        service.wait_for_topics()
        service.consumer.subscribe(settings.kafka.topics, listener=service.revocations)
        return service

    yield make
    for service in services:
        service.consumer.close()
        service.dlq.flush(5)
        service.relay.close()
        service.wake.close()


def produce(service: SchedulerService, priority: Priority, n: int) -> list[str]:
    """`n` jobs produced straight to the class's topic (the scheduler records them)."""
    producer = make_producer(service.settings.kafka, client_id="test-producer")
    topic = service.settings.kafka.topics[list(Priority).index(priority)]
    jobs = [JobRequest(job_id=f"{priority.value}-{i}-{time.monotonic_ns()}", tenant="acme", priority=priority,
                       model="builtin:tiny", max_new_tokens=2, submitted_at=time.time(), prompt_tokens=[1] * 8)
            for i in range(n)]
    try:
        for job in jobs:
            producer.send(topic, key=b"acme", value=encode(job))
        producer.flush(timeout=10)
    finally:
        producer.close()
    return [j.job_id for j in jobs]


def budget(service: SchedulerService, tokens: int) -> None:
    registry.publish(service.dispatcher.store.client, service.settings.redis.keys,
                     WorkerHeartbeat(worker_id="fake", capacity_tokens=tokens), ttl_ms=600_000)


def step_until(service: SchedulerService, done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out: {what}"
        service.step()


def step_until_admitted(service: SchedulerService, job_ids: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := Counter(states(service, job_ids))) != {"admitted": len(job_ids)}:
        assert time.monotonic() < deadline, f"not every job admitted: {dict(now)}"
        service.step()


def states(service: SchedulerService, job_ids: list[str]) -> list[str]:
    return [s.value if s else "missing" for s in service.dispatcher.store.states(job_ids)]


def assert_admitted_once(service: SchedulerService, sent: dict[Priority, list[str]]) -> None:
    """Every job admitted, its tokens reserved once, one Celery task sent for it."""
    client, prefix = service.dispatcher.store.client, service.settings.redis.key_prefix
    everyone = [j for job_ids in sent.values() for j in job_ids]
    assert states(service, everyone) == ["admitted"] * len(everyone)
    assert Ledger(client, service.settings.redis.keys).in_use() == COST * len(everyone)
    for priority, job_ids in sent.items():
        assert client.llen(celery_queue(prefix, priority)) == len(job_ids)


def committed(service: SchedulerService, tp: TopicPartition) -> int:
    admin = KafkaAdminClient(**service.settings.kafka.client_options)
    try:
        offsets = admin.list_group_offsets({service.settings.kafka.group: None})[service.settings.kafka.group]
        return offsets[tp].offset if tp in offsets else -1
    finally:
        admin.close()


def test_a_partition_a_rebalance_gives_back_to_the_same_member_is_read_again(scheduler):
    # The burst is on Kafka before the scheduler starts; with no budget it buffers it all.
    service = scheduler()
    jobs = produce(service, Priority.NORMAL, 40)
    step_until(service, lambda: len(service.waiting) == 40, "the burst buffered")
    normal = TopicPartition(service.settings.kafka.topics[1], 0)
    # A second member joins the group for the low topic only: the (eager) rebalance
    # revokes every partition of the scheduler, and the range assignor gives the normal
    # partition back to it, the only member subscribed to that topic.
    other = make_consumer(service.settings.kafka, client_id="second-member", max_poll_records=1,
                          fetch_max_wait_ms=service.settings.scheduler.fetch_max_wait_ms)
    other.subscribe([service.settings.kafka.topics[2]])
    stop = threading.Event()

    def keep_polling() -> None:  # a member that stops polling holds up the rebalance
        while not stop.is_set():
            other.poll(timeout_ms=100)

    joined = threading.Thread(target=keep_polling)
    joined.start()
    try:
        revoked: list[set[TopicPartition]] = []
        take = service.revocations.take

        def noted() -> set[TopicPartition]:
            revoked.append(taken := take())
            return taken

        service.revocations.take = noted
        step_until(service, lambda: any(normal in r for r in revoked) and not service.revocations.unassigned_for()
                   and normal in service.consumer.assignment(),
                   "the rebalance done, the normal partition back with the scheduler")
        budget(service, COST * 40)
        step_until_admitted(service, jobs, timeout=20)
        service.commit(force=True)
        assert_admitted_once(service, {Priority.NORMAL: jobs})
        assert committed(service, normal) == 40
    finally:
        stop.set()
        joined.join()
        other.close()


def test_a_paused_partition_whose_fetched_records_were_parked_is_read_again_when_resumed(scheduler):
    # One poll takes 5 of the 40 low jobs the consumer fetched; at 4 buffered the policy
    # pauses the low partition, and the next poll parks the 35 it still holds
    # (`Fetcher._paused_partition_records`). A normal job read after that leaves the
    # consumer's in-line slot holding a used-up batch, which kept kafka-python 3.0.12
    # from ever restoring the parked records once low was resumed, and from fetching the
    # partition again.
    service = scheduler(max_buffered=4, max_poll_records=5)
    low = TopicPartition(service.settings.kafka.topics[2], 0)
    jobs = produce(service, Priority.LOW, 40)
    step_until(service, lambda: low in service.consumer.paused(), "the low partition paused")
    parked = service.consumer._fetcher._paused_partition_records
    step_until(service, lambda: low in parked, "the consumer parked the low records it held")
    normal = produce(service, Priority.NORMAL, 1)
    step_until(service, lambda: normal[0] in service.waiting, "a normal job read after the parking")
    assert service.policy.pending(Priority.LOW) < 40  # the rest waits in Kafka (or parked)
    budget(service, COST * 41)
    step_until_admitted(service, jobs + normal, timeout=20)
    service.commit(force=True)
    assert_admitted_once(service, {Priority.LOW: jobs, Priority.NORMAL: normal})
    assert committed(service, low) == 40


def test_the_consumer_fetches_with_the_scheduler_s_wait_not_kafka_python_s(scheduler):
    # kafka-python keeps one fetch in flight per broker: a partition resumed while a
    # fetch for the other (empty) partitions waits on the broker is read only when that
    # fetch returns, after up to fetch.max.wait.ms. At kafka-python's 500 ms a class that
    # drained under a backlog left the fleet idle that long (docs/benchmarks.md, "A
    # resumed partition's fetch"); the scheduler's own setting bounds it.
    service = scheduler()
    assert service.settings.scheduler.fetch_max_wait_ms == 100
    assert service.consumer.config["fetch_max_wait_ms"] == 100
    assert service.consumer._fetcher.config["fetch_max_wait_ms"] == 100  # what each fetch request carries


def test_a_dead_letter_kafka_did_not_take_is_read_again_and_dead_lettered_later(scheduler):
    import dataclasses
    import logging

    from kvfleet.kafka import DeliveryFailed, make_batch_producer

    service = scheduler()
    topic, tp = service.settings.kafka.topics[1], TopicPartition(service.settings.kafka.topics[1], 0)
    producer = make_producer(service.settings.kafka, client_id="test-producer")
    try:
        producer.send(topic, key=b"acme", value=b"not json", headers=[("job_id", b"broken")])
        producer.flush(timeout=10)
    finally:
        producer.close()
    working = service.dlq
    # A dead-letter producer whose broker is nowhere: librdkafka gives up after half a second.
    service.dlq = make_batch_producer(dataclasses.replace(service.settings.kafka, bootstrap="127.0.0.1:1"),
                                      client_id="test-dlq", logger=logging.getLogger("rdkafka"),
                                      **{"message.timeout.ms": 500, "request.timeout.ms": 500})
    deadline = time.monotonic() + 30
    with pytest.raises(DeliveryFailed, match="dead letters"):
        while time.monotonic() < deadline:  # until the poll returns the record
            service.step()
    assert service.consumer.position(tp) == 0 and committed(service, tp) == -1  # rewound, nothing decided
    service.dlq = working  # Kafka takes dead letters again: the record is read again and goes
    step_until(service, lambda: committed(service, tp) == 1, "the record dead-lettered and committed")
    consumer = make_consumer(dataclasses.replace(service.settings.kafka, group=f"{service.settings.kafka.group}-dlq"),
                             client_id="test-dlq-reader", max_poll_records=10, fetch_max_wait_ms=100)
    try:
        consumer.subscribe([service.settings.kafka.dlq])
        letters: list = []
        deadline = time.monotonic() + 30
        while not letters:
            assert time.monotonic() < deadline, "no dead letter"
            letters += [r for rs in consumer.poll(timeout_ms=200).values() for r in rs]
    finally:
        consumer.close()
    assert [(r.value, dict(r.headers)["reason"]) for r in letters] == [(b"not json", b"undecodable")]
