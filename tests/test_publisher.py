"""The produce of a submission (producer/publisher.py) holds no thread while Kafka
acknowledges it, and every way Kafka can refuse it is a 503 that queued nothing:
an error, no acknowledgement in time, a producer that cannot be made. A fake producer
stands in for kafka-python, so each outcome is exact; tests/test_api_retry.py does the
same through the real fleet with an unreachable Kafka."""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

import msgspec
import pytest
from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from kafka.future import Future
from kafka.producer.future import RecordMetadata

from kvfleet.contracts import JobRequest, Priority, decode_request
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable
from producer.publisher import Publisher

JOB = JobRequest(job_id="job-1", tenant="acme", priority=Priority.HIGH, model="builtin:tiny", max_new_tokens=4,
                 submitted_at=1.0, prompt_tokens=[7, 8])
TOPIC = "kvfleet.requests.high"


class FakeMetadata:
    def __init__(self, known: bool) -> None:
        self.known = known

    def partitions_for_topic(self, topic: str) -> Optional[set]:
        return {0} if self.known else None


class FakeProducer:
    """kafka-python's send: a future, settled later on another thread (as its sender
    thread does), or never."""

    def __init__(self, *, known: bool = True, outcome: object = "ack", after_s: float = 0.01) -> None:
        self._metadata = FakeMetadata(known)
        self.outcome, self.after_s = outcome, after_s
        self.sent: list[tuple[str, dict, str]] = []

    def send(self, topic: str, **record) -> Future:
        self.sent.append((topic, record, threading.current_thread().name))
        future = Future()
        if self.outcome == "ack":
            meta = RecordMetadata(topic, 0, None, 41, 0, None, 0, 0, 0)
            threading.Timer(self.after_s, future.success, [meta]).start()
        elif isinstance(self.outcome, Exception):
            threading.Timer(self.after_s, future.failure, [self.outcome]).start()
        return future  # "never": no acknowledgement ever comes

    def close(self, timeout: float = 0) -> None:
        pass


def _publisher(producer: Optional[FakeProducer]) -> Publisher:
    publisher = Publisher(KafkaSettings(bootstrap="127.0.0.1:1"))
    publisher._producer = producer
    return publisher


def test_an_acknowledged_produce_returns_the_record_sent_from_the_event_loop():
    producer = FakeProducer()

    async def publish():
        return await _publisher(producer).publish(JOB), threading.current_thread().name

    value, loop_thread = asyncio.run(publish())
    assert decode_request(value) == JOB
    [(topic, record, sent_on)] = producer.sent
    assert topic == TOPIC and record["key"] == b"acme" and record["value"] == value
    assert dict(record["headers"]) == {"job_id": b"job-1", "v": b"1"}
    assert sent_on == loop_thread  # metadata known: send only appends to a batch, on the loop


def test_without_the_topic_s_metadata_the_send_runs_on_a_worker_thread():
    producer = FakeProducer(known=False)  # kafka-python's send would wait for metadata

    async def publish():
        await _publisher(producer).publish(JOB)
        return threading.current_thread().name

    loop_thread = asyncio.run(publish())
    assert producer.sent[0][2] != loop_thread


def test_many_produces_wait_together_without_a_thread_each():
    producer = FakeProducer(after_s=0.2)

    async def publish_all():
        publisher = _publisher(producer)
        jobs = [msgspec.structs.replace(JOB, job_id=f"job-{i}") for i in range(200)]
        return await asyncio.gather(*(publisher.publish(job) for job in jobs))

    assert len(asyncio.run(asyncio.wait_for(publish_all(), 5))) == 200  # 200 waits of 0.2 s at once


@pytest.mark.parametrize("producer, reason", [
    (FakeProducer(outcome=KafkaTimeoutError("Batch expired")), "Batch expired"),  # Kafka refused it
    (FakeProducer(outcome="never"), "no acknowledgement"),  # no answer within the timeout
])
def test_a_produce_kafka_did_not_acknowledge_is_a_503(producer, reason):
    with pytest.raises(QueueUnavailable) as refused:
        asyncio.run(_publisher(producer).publish(JOB, timeout_s=0.3))
    assert refused.value.status == 503 and reason in refused.value.message
    assert "nothing was queued" in refused.value.message and refused.value.extra == {"job_id": "job-1"}


def test_a_producer_that_cannot_be_made_is_a_503(monkeypatch):
    def unreachable(*args, **kwargs):
        raise KafkaConnectionError("no broker answered")

    monkeypatch.setattr("producer.publisher.make_producer", unreachable)
    with pytest.raises(QueueUnavailable):
        asyncio.run(_publisher(None).publish(JOB))
