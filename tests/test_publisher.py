"""The produce of a submission (producer/publisher.py), against the real broker: it holds
no thread while Kafka acknowledges it, it lands in the partition kafka-python would have
chosen for the same tenant, and every way Kafka can refuse it is a 503 that queued
nothing: a record the broker rejects, no acknowledgement in time, a full queue.
tests/test_api_retry.py does the same through the whole fleet with an unreachable Kafka."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

from kvfleet import constants
from kvfleet.contracts import JobRequest, Priority, decode_request
from kvfleet.kafka import ensure_topics, make_admin, make_producer
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable
from producer.publisher import Publisher

JOB = JobRequest(job_id="job-1", tenant="acme", priority=Priority.HIGH, model="builtin:tiny", max_new_tokens=4,
                 submitted_at=1.0, prompt_tokens=[7, 8])
UNREACHABLE = KafkaSettings(bootstrap="127.0.0.1:1")  # nothing listens on port 1


@pytest.fixture
def kafka(kafka_bootstrap, prefix) -> KafkaSettings:
    settings = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=prefix)
    ensure_topics(settings)
    return settings


@pytest.fixture
def publisher(kafka):
    publisher = Publisher(kafka)
    yield publisher
    publisher.close()


@pytest.fixture
def partitioning_topic(kafka) -> str:
    """A topic with as many partitions as a request topic, for kafka-python's choices."""
    topic = f"{kafka.topic_prefix}.partitioning"
    admin = make_admin(kafka, client_id="test-admin")
    admin.create_topics([NewTopic(topic, kafka.partitions, 1)])
    admin.close()
    return topic


def _records(kafka: KafkaSettings, topic: str) -> list:
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000)
    partitions = [TopicPartition(topic, p) for p in range(kafka.partitions)]
    consumer.assign(partitions)
    ends = consumer.end_offsets(partitions)
    records = []
    while sum(consumer.position(tp) for tp in partitions) < sum(ends.values()):
        for batch in consumer.poll(timeout_ms=1000).values():
            records.extend(batch)
    consumer.close()
    return records


def test_an_acknowledged_produce_lands_where_kafka_python_puts_the_same_tenant(kafka, publisher, partitioning_topic):
    tenants = [f"tenant-{i}" for i in range(12)]  # enough keys to cross every partition
    jobs = [msgspec.structs.replace(JOB, job_id=f"job-{t}", tenant=t) for t in tenants]

    async def publish_all():
        return await asyncio.gather(*(publisher.publish(job) for job in jobs))

    values = asyncio.run(publish_all())
    assert [decode_request(v) for v in values] == jobs
    topic = constants.request_topic(kafka.topic_prefix, Priority.HIGH)
    by_job = {dict(r.headers)["job_id"].decode(): r for r in _records(kafka, topic)}
    assert set(by_job) == {job.job_id for job in jobs}
    reference = make_producer(kafka, client_id="test-reference")  # what kafka-python chooses for the key
    try:
        for job, value in zip(jobs, values):
            record = by_job[job.job_id]
            assert record.key == job.tenant.encode() and record.value == value
            assert dict(record.headers) == {"job_id": job.job_id.encode(), "v": b"1"}
            expected = reference.send(partitioning_topic, key=job.tenant.encode(), value=b"")
            assert record.partition == expected.get(timeout=10).partition, job.tenant
    finally:
        reference.close()
    assert len({r.partition for r in by_job.values()}) > 1  # the keys did spread


def test_many_produces_wait_together_without_a_thread_each(publisher):
    jobs = [msgspec.structs.replace(JOB, job_id=f"job-{i}") for i in range(300)]
    publisher.producer  # its reporting thread: one per process
    threads_before = threading.active_count()
    most = 0

    async def publish_all():
        nonlocal most
        pending = [asyncio.ensure_future(publisher.publish(job)) for job in jobs]
        while not all(p.done() for p in pending):
            most = max(most, threading.active_count())
            await asyncio.sleep(0)
        return await asyncio.gather(*pending)

    assert len(asyncio.run(asyncio.wait_for(publish_all(), 30))) == 300
    assert most <= threads_before


def test_a_record_the_broker_refuses_is_a_503_and_nothing_is_on_the_topic(kafka_bootstrap, prefix):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=prefix)
    topic = constants.request_topic(prefix, Priority.HIGH)
    admin = make_admin(kafka, client_id="test-admin")
    admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "256"})])
    admin.close()
    big = msgspec.structs.replace(JOB, prompt_tokens=[7] * 400)  # well over 256 bytes: the broker says no
    publisher = Publisher(kafka)
    try:
        with pytest.raises(QueueUnavailable) as refused:
            asyncio.run(publisher.publish(big))
    finally:
        publisher.close()
    assert refused.value.status == 503 and "too large" in refused.value.message
    assert "nothing was queued" in refused.value.message and refused.value.extra == {"job_id": "job-1"}
    assert _records(KafkaSettings(bootstrap=kafka_bootstrap, partitions=1), topic) == []


def test_no_acknowledgement_in_time_is_a_503():
    publisher = Publisher(UNREACHABLE)
    try:
        with pytest.raises(QueueUnavailable) as refused:
            asyncio.run(publisher.publish(JOB, timeout_s=0.5))
    finally:
        publisher.close(timeout_s=0)
    assert refused.value.status == 503 and "no acknowledgement from Kafka within 0.5 s" in refused.value.message
    assert "retry later with the same job_id" in refused.value.message


def test_a_full_queue_is_a_503_at_once():
    publisher = Publisher(UNREACHABLE, **{"queue.buffering.max.messages": 1})

    async def two():
        first = asyncio.ensure_future(publisher.publish(JOB, timeout_s=30))  # waits: nothing is reachable
        await asyncio.sleep(0)
        try:
            with pytest.raises(QueueUnavailable) as refused:
                await publisher.publish(msgspec.structs.replace(JOB, job_id="job-2"), timeout_s=30)
            return refused.value
        finally:
            first.cancel()

    try:
        refused = asyncio.run(asyncio.wait_for(two(), 10))  # at once, not after its 30 s
    finally:
        publisher.close(timeout_s=0)
    assert refused.status == 503 and "Queue full" in refused.message and refused.extra == {"job_id": "job-2"}


def test_ready_is_whether_the_cluster_lists_every_request_topic(kafka_bootstrap, prefix):
    missing = Publisher(KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=prefix))
    unreachable = Publisher(UNREACHABLE)
    try:
        assert not missing.ready()  # the broker answers, but the topics are not there yet
        ensure_topics(missing.kafka)
        assert missing.ready()
        assert not unreachable.ready(timeout_s=0.5)
    finally:
        missing.close()
        unreachable.close(timeout_s=0)
