"""Results on Kafka (kvfleet/results.py): every terminal result reaches `<prefix>.results`
or its job's `reply_to` topic, keyed and correlated by job id, at least once and never
different, through the job store's outbox, on the real Redis and Kafka.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections import defaultdict
from typing import Callable

import httpx
import msgspec
import pytest
from confluent_kafka import Consumer as ForeignConsumer, Producer as ForeignProducer
from confluent_kafka.admin import AdminClient as ForeignAdmin, NewTopic as ForeignNewTopic
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from kvfleet import constants
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Timings, Usage, decode_request, decode_result
from kvfleet.jobstore import JobStore
from kvfleet.kafka import DeliveryFailed, ensure_topics, make_batch_producer
from kvfleet.results import KnownTopics, ResultRelay
from kvfleet.settings import KafkaSettings
from tests.fleet import Fleet

Message = tuple[bytes, bytes, dict[str, bytes]]  # key, value, headers


def _job(job_id: str, **fields) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                      max_new_tokens=2, submitted_at=time.time(), prompt="hi", **fields)


def _done(job: JobRequest) -> JobResult:
    return JobResult(job_id=job.job_id, status=JobState.DONE, tenant=job.tenant, priority=job.priority,
                     text="ok", tokens=[1, 2], usage=Usage(1, 2, 0), timings=Timings(finished_at=time.time()))


def read_topic(bootstrap: str, topic: str, enough: Callable[[list[Message]], bool], *,
               timeout: float = 60.0) -> list[Message]:
    """Every message on `topic` from its start, read until `enough` says so and no
    partition has more (its end offset reached)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout
        while not consumer.partitions_for_topic(topic):
            assert time.monotonic() < deadline, f"no metadata for {topic}"
            time.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        messages: list[Message] = []
        while True:
            for records in consumer.poll(timeout_ms=200).values():
                messages += [(r.key, r.value, dict(r.headers)) for r in records]
            if enough(messages):
                ends = consumer.end_offsets(tps)
                if all(consumer.position(tp) >= ends[tp] for tp in tps):
                    return messages
            assert time.monotonic() < deadline, f"{topic}: only {len(messages)} messages after {timeout:.0f} s"
    finally:
        consumer.close()


def by_job(messages: list[Message]) -> dict[str, list[Message]]:
    out: dict[str, list[Message]] = defaultdict(list)
    for message in messages:
        out[message[2]["correlation_id"].decode()].append(message)
    return out


def assert_never_different(copies: dict[str, list[Message]]) -> None:
    """Duplicates are allowed (at least once), but only as the same bytes."""
    for job_id, messages in copies.items():
        assert all(m == messages[0] for m in messages), f"{job_id}: different results for one id"
        key, value, headers = messages[0]
        assert key == job_id.encode() and decode_result(value).job_id == job_id
        assert headers["kafka_correlationId"] == headers["job_id"] == job_id.encode()
        assert headers["status"] == decode_result(value).status.value.encode()


# --- the contract and the outbox ----------------------------------------------------

def test_reply_to_is_optional_and_must_be_a_kafka_topic_name():
    assert _job("a").reply_to is None
    assert decode_request(msgspec.json.encode(_job("a"))).reply_to is None  # v1 messages without it decode
    for good in ("replies", "team-a.replies_v2", "x" * 249):
        assert decode_request(msgspec.json.encode(_job("a", reply_to=good))).reply_to == good
    for bad in ("", ".", "..", "a/b", "spaces are not allowed", "x" * 250):
        raw = msgspec.json.encode({**msgspec.to_builtins(_job("a")), "reply_to": bad})
        with pytest.raises(msgspec.ValidationError, match="reply_to"):
            decode_request(raw)


def test_the_call_that_ends_a_job_queues_its_result_for_kafka_exactly_once(redis_client, prefix):
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    store.create(_job("a", reply_to="replies"))
    store.create(_job("b"))
    assert store.field("a", "reply_to") == "replies" and store.field("b", "reply_to") is None
    assert store.start("a", now=time.time(), worker="w").ok  # done is reached from running only
    assert store.finish(_done(_job("a"))).ok
    assert store.fail("b", JobState.REJECTED, "unknown_tenant", "no such tenant", now=time.time()).ok
    assert not store.finish(_done(_job("a"))).ok  # a second end changes nothing ...
    assert not store.fail("b", JobState.CANCELLED, "cancelled", "too late", now=time.time()).ok
    entries = redis_client.xrange(keys.results_outbox)
    assert len(entries) == 2  # ... and queues nothing
    fields = [{k.decode(): v for k, v in f.items()} for _, f in entries]
    assert [(f["job_id"], f["status"], f["reply_to"]) for f in fields] == [
        (b"a", b"done", b"replies"), (b"b", b"rejected", b"")]
    # The outbox holds the very bytes the job store kept: what is produced is what was written.
    assert [f["result"] for f in fields] == [redis_client.hget(keys.job(j), "result") for j in ("a", "b")]
    with pytest.raises(ValueError, match="terminal"):  # no other way to a terminal state
        store.transition("b", JobState.DONE)


def test_known_topics_asks_the_broker_again_on_a_miss_at_most_once_per_interval():
    now, calls, broker = [0.0], [], {"a"}

    def list_topics() -> set[str]:
        calls.append(now[0])
        return set(broker)

    topics = KnownTopics(list_topics, refresh_s=1.0, clock=lambda: now[0])
    assert "a" in topics and "b" not in topics and calls == [0.0]
    broker.add("b")
    assert "b" not in topics and calls == [0.0]  # a miss within the interval: no new read
    now[0] = 1.0
    assert "b" in topics and "a" in topics and calls == [0.0, 1.0]


# --- the relay on the real Redis and Kafka --------------------------------------------

class Crash(BaseException):
    """The relay's process dying: nothing after this point runs."""


class CrashBeforeAck(ResultRelay):
    def ack(self, entry_ids: list[bytes]) -> None:
        if entry_ids:
            raise Crash()
        super().ack(entry_ids)


def _relay(cls: type[ResultRelay], redis_client, kafka: KafkaSettings, prefix: str, producer, admin, *,
           consumer: str, **options) -> ResultRelay:
    return cls(redis_client, Keys(prefix), producer, KnownTopics(admin.list_topics), results_topic=kafka.results,
               reserved_topics=[*kafka.topics, kafka.dlq], consumer=consumer, **options)


def test_a_relay_killed_between_produce_and_ack_produces_the_same_results_again(redis_client, kafka_bootstrap,
                                                                                   prefix):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=f"{prefix}.requests", partitions=2)
    ensure_topics(kafka)
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    jobs = [_job("plain"), _job("lost-reply", reply_to=f"{prefix}.nobody-made-this"),
            _job("loop", reply_to=kafka.topics[0])]  # a request topic: a result there would be dead-lettered
    for job in jobs:
        store.create(job)
        assert store.start(job.job_id, now=time.time(), worker="w").ok
        assert store.finish(_done(job)).ok
    producer = make_batch_producer(kafka, client_id="results-test", logger=logging.getLogger("rdkafka"))
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        doomed = _relay(CrashBeforeAck, redis_client, kafka, prefix, producer, admin, consumer="doomed",
                        claim_idle_ms=3_600_000)  # it never claims: it is the one that dies
        doomed.ensure_group()
        with pytest.raises(Crash):
            doomed.step()  # produced all three, acknowledged none
        first = read_topic(kafka_bootstrap, kafka.results, lambda ms: len(ms) >= 3)
        assert sorted(by_job(first)) == ["loop", "lost-reply", "plain"]
        assert redis_client.xpending(keys.results_outbox, constants.RESULTS_RELAY_GROUP)["pending"] == 3

        heir = _relay(ResultRelay, redis_client, kafka, prefix, producer, admin, consumer="heir", claim_idle_ms=0)
        assert heir.step() == 3  # claims what the dead relay left, produces it again
        assert heir.step() == 0 and redis_client.xlen(keys.results_outbox) == 0
        assert redis_client.xpending(keys.results_outbox, constants.RESULTS_RELAY_GROUP)["pending"] == 0
    finally:
        producer.flush(5)
        admin.close()

    copies = by_job(read_topic(kafka_bootstrap, kafka.results, lambda ms: len(ms) >= 6))
    assert {j: len(ms) for j, ms in copies.items()} == {"plain": 2, "lost-reply": 2, "loop": 2}
    assert_never_different(copies)
    for job_id, messages in copies.items():
        assert messages[0][1] == redis_client.hget(keys.job(job_id), "result")
    # A reply_to that cannot be used: the default topic, saying which topic and why.
    assert copies["plain"][0][2].keys().isdisjoint({"reply_to", "reply_to_error"})
    assert copies["lost-reply"][0][2]["reply_to"] == f"{prefix}.nobody-made-this".encode()
    assert copies["lost-reply"][0][2]["reply_to_error"] == b"unknown_topic"
    assert copies["loop"][0][2]["reply_to_error"] == b"reserved_topic"


def test_results_that_arrive_while_the_relay_gathers_share_its_next_batch(redis_client, kafka_bootstrap, prefix):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=f"{prefix}.requests", partitions=2)
    ensure_topics(kafka)
    store = JobStore(redis_client, Keys(prefix))

    def finish(job_id: str) -> None:
        job = _job(job_id)
        store.create(job)
        assert store.start(job_id, now=time.time(), worker="w").ok
        assert store.finish(_done(job)).ok

    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the next engine step's jobs end while the relay waits
        waits.append(seconds)
        if len(waits) == 1:
            for job_id in ("b", "c", "d"):
                finish(job_id)

    finish("a")
    producer = make_batch_producer(kafka, client_id="results-test", logger=logging.getLogger("rdkafka"))
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        relay = _relay(ResultRelay, redis_client, kafka, prefix, producer, admin, consumer="gatherer",
                       gather_s=60.0, sleep=sleep)
        relay.ensure_group()
        assert relay.step() == 1 and waits == []  # found idle: the first result goes at once
        assert relay.step() == 3  # behind a batch: it waited, and the three went as one
        assert len(waits) == 1 and 59.0 < waits[0] <= 60.0
    finally:
        producer.flush(5)
        admin.close()
    assert sorted(by_job(read_topic(kafka_bootstrap, kafka.results, lambda ms: len(ms) >= 4))) == ["a", "b", "c", "d"]


def test_results_kafka_did_not_take_stay_pending_and_go_with_the_next_step(redis_client, kafka_bootstrap, prefix):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=f"{prefix}.requests", partitions=2)
    ensure_topics(kafka)
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    for job_id in ("a", "b"):
        job = _job(job_id)
        store.create(job)
        assert store.start(job_id, now=time.time(), worker="w").ok
        assert store.finish(_done(job)).ok
    log = logging.getLogger("rdkafka")
    # A broker nobody listens on: librdkafka gives up on each record after half a second.
    nowhere = make_batch_producer(dataclasses.replace(kafka, bootstrap="127.0.0.1:1"), client_id="results-test",
                                  logger=log, **{"message.timeout.ms": 500, "request.timeout.ms": 500})
    working = make_batch_producer(kafka, client_id="results-test", logger=log)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        relay = _relay(ResultRelay, redis_client, kafka, prefix, nowhere, admin, consumer="relay")
        relay.ensure_group()
        with pytest.raises(DeliveryFailed, match="2 of 2 results"):
            relay.step()
        # Nothing acknowledged that Kafka did not take: both still pending, under this relay.
        assert redis_client.xlen(keys.results_outbox) == 2
        assert redis_client.xpending(keys.results_outbox, constants.RESULTS_RELAY_GROUP)["pending"] == 2
        relay.producer = working  # Kafka is back
        assert relay.step() == 2  # its own pending entries first
        assert redis_client.xlen(keys.results_outbox) == 0
    finally:
        working.flush(5)
        admin.close()
    assert sorted(by_job(read_topic(kafka_bootstrap, kafka.results, lambda ms: len(ms) >= 2))) == ["a", "b"]


# --- through a real fleet --------------------------------------------------------------

def test_every_native_result_reaches_the_results_topic_once_done_expired_or_cancelled(make_fleet):
    # A budget of 100 tokens: small jobs run, a 150-token one never fits and waits.
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_CAPACITY_CEILING_TOKENS": "100"})
    done = [fleet.submit(("high", "normal", "low")[i % 3], prompt_len=4 + i, max_new_tokens=2) for i in range(6)]
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in done), "the small jobs done", timeout=120)
    expired = fleet.submit("normal", prompt_len=142, max_new_tokens=8, timeout_s=1.0)
    waiting = fleet.submit("low", prompt_len=142, max_new_tokens=8)
    cancel = httpx.delete(f"{fleet.url}/v1/jobs/{waiting}", headers={"X-Tenant-ID": "acme"})
    assert cancel.status_code == 200, cancel.text
    fleet.wait_for(lambda: fleet.state(expired) == "expired", "the waiting job expired")
    ids = {*done, expired, waiting}
    # Every result relayed and acknowledged: nothing more can come than what is read now.
    fleet.wait_for(lambda: fleet.redis.xlen(fleet.keys.results_outbox) == 0, "the outbox drained")
    copies = by_job(read_topic(fleet.env["KVFLEET_KAFKA_BOOTSTRAP"], f"{fleet.prefix}.requests.results",
                               lambda ms: ids <= set(by_job(ms))))
    assert set(copies) == ids
    assert_never_different(copies)
    statuses = {j: decode_result(ms[0][1]).status for j, ms in copies.items()}
    assert statuses == {**{j: JobState.DONE for j in done}, expired: JobState.EXPIRED, waiting: JobState.CANCELLED}
    for job_id, messages in copies.items():  # exactly what GET /v1/jobs/{id} answers
        assert messages[0][1] == fleet.field(job_id, "result").encode()


TENANTS = {"tenants": [{"name": "acme", "tier": "gold", "tokens_per_minute": 1_000_000}]}


def test_a_foreign_kafka_client_gets_its_replies_by_correlation_id(make_fleet):
    fleet: Fleet = make_fleet(workers=1, extra_env={"KVFLEET_TENANTS": json.dumps(TENANTS)})
    bootstrap = fleet.env["KVFLEET_KAFKA_BOOTSTRAP"]
    replies = f"{fleet.prefix}.replies"
    admin = ForeignAdmin({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([ForeignNewTopic(replies, num_partitions=1, replication_factor=1)]).values():
        future.result(30)  # the requester makes its reply topic before it asks

    # librdkafka, not kvfleet's code: plain JSON that follows the documented contract.
    def request(job_id: str, *, tenant: str = "acme", reply_to: str = replies) -> bytes:
        return json.dumps({"job_id": job_id, "tenant": tenant, "priority": "normal", "model": "builtin:tiny",
                           "prompt": f"question {job_id}", "max_new_tokens": 3, "submitted_at": time.time(),
                           "reply_to": reply_to, "v": 1}).encode()

    run = uuid.uuid4().hex[:8]
    asked = {f"ask-{run}-{i}": "done" for i in range(4)}
    asked[f"ask-{run}-stranger"] = "rejected"  # no such tenant: the scheduler refuses it, and says so
    producer = ForeignProducer({"bootstrap.servers": bootstrap, "acks": "all"})
    for job_id, status in asked.items():
        tenant = "acme" if status == "done" else "nobody"
        producer.produce(f"{fleet.prefix}.requests.normal", key=tenant, value=request(job_id, tenant=tenant))
    lost = f"ask-{run}-typo"  # a reply topic that does not exist: the result is not lost
    producer.produce(f"{fleet.prefix}.requests.normal", key="acme", value=request(lost, reply_to=f"{replies}-typo"))
    assert producer.flush(30) == 0

    consumer = ForeignConsumer({"bootstrap.servers": bootstrap, "group.id": f"{fleet.prefix}-requester",
                                "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([replies])
    answers: dict[str, JobResult] = {}
    try:
        deadline = time.monotonic() + 120
        while set(answers) != set(asked):
            assert time.monotonic() < deadline, f"replies for {sorted(answers)} only\n{fleet.logs()}"
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            headers = dict(message.headers() or [])
            correlation = headers["correlation_id"].decode()
            assert correlation in asked, f"a reply nobody asked for: {correlation}"
            result = decode_result(message.value())
            assert result.job_id == correlation == message.key().decode()
            assert answers.setdefault(correlation, result) == result  # a duplicate is the same result
    finally:
        consumer.close()
    assert {j: r.status.value for j, r in answers.items()} == asked
    assert all(len(r.tokens) == 3 for r in answers.values() if r.status is JobState.DONE)
    stranger = answers[f"ask-{run}-stranger"]
    assert stranger.error is not None and stranger.error.code == "unknown_tenant"

    fallback = by_job(read_topic(bootstrap, f"{fleet.prefix}.requests.results", lambda ms: lost in by_job(ms)))
    assert set(fallback) == {lost}  # every other result went to the topic its job named
    assert_never_different(fallback)
    headers = fallback[lost][0][2]
    assert headers["reply_to"] == f"{replies}-typo".encode() and headers["reply_to_error"] == b"unknown_topic"
    assert decode_result(fallback[lost][0][1]).status is JobState.DONE
