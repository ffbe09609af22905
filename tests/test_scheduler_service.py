"""The scheduler service through the real API, Kafka and Redis, without workers: the
test plays the workers by publishing a capacity and releasing reservations, so every
admission decision is the scheduler's alone and can be checked exactly. Plus the
service's parts on their own (commit positions, configuration, intake's recovery)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace
from typing import Optional

import httpx
import pytest
import redis as redis_lib
from kafka import TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority, encode
from kvfleet.jobstore import Admit, JobStore
from kvfleet.settings import KafkaSettings, RedisSettings, Settings
from scheduler.config import Tenancy, policy_config
from scheduler.intake import PromptLength
from scheduler.ledger import Ledger
from scheduler.offsets import OffsetBook
from scheduler.service import SchedulerService
from tests.fleet import Fleet, free_port


def submit(fleet: Fleet, priority: str, cost: int, **body) -> str:
    """A job reserving exactly `cost` tokens."""
    return fleet.submit(priority, prompt_len=cost - 8, max_new_tokens=8, **body)


def admitted(fleet: Fleet, job_ids: list[str]) -> list[str]:
    return [j for j in job_ids if fleet.state(j) == "admitted"]


def test_under_contention_high_is_admitted_before_normal_before_low(make_fleet):
    fleet = make_fleet(workers=0)
    fleet.fake_capacity(1000)
    ledger = Ledger(fleet.redis, fleet.keys)
    blocker = submit(fleet, "normal", 1000)
    fleet.wait_for(lambda: admitted(fleet, [blocker]), "blocker admitted")
    jobs = [submit(fleet, p, 1000) for p in ("low", "normal", "high") for _ in range(3)]
    time.sleep(0.5)  # all read and buffered; none fits
    assert not admitted(fleet, jobs)
    order, current = [], blocker
    for _ in jobs:  # play a worker that runs one job at a time
        ledger.release(current)
        current = fleet.wait_for(lambda: admitted(fleet, [j for j in jobs if j not in order]), "next admission")[0]
        order.append(current)
    assert [jobs.index(j) // 3 for j in order] == [2, 2, 2, 1, 1, 1, 0, 0, 0]  # high, normal, low
    assert order == sorted(order, key=lambda j: (-(jobs.index(j) // 3), jobs.index(j)))  # FIFO within a class


def test_a_long_job_is_not_starved_by_a_stream_of_short_ones(make_fleet):
    # Budget 1000; short jobs of 400 (two at a time) and one long job of 900.
    fleet = make_fleet(workers=0, extra_env={"KVFLEET_NORMAL_RESERVE_AFTER_S": "1"})
    fleet.fake_capacity(1000)
    ledger = Ledger(fleet.redis, fleet.keys)
    shorts = [submit(fleet, "normal", 400) for _ in range(2)]
    fleet.wait_for(lambda: len(admitted(fleet, shorts)) == 2, "two short jobs running")
    long = submit(fleet, "normal", 900)
    released: set[str] = set()
    started = time.monotonic()
    # Play the workers: every 0.25 s the oldest short job ends and a new one arrives, so
    # without a hold a short one always takes the 600 tokens that free up.
    while fleet.state(long) != "admitted" and time.monotonic() - started < 6.0:
        running = [j for j in admitted(fleet, shorts) if j not in released]
        if running:
            ledger.release(running[0])
            released.add(running[0])
        shorts.append(submit(fleet, "normal", 400))
        time.sleep(0.25)
    assert fleet.state(long) == "admitted", "starved: short jobs kept taking the tokens it needs"
    waited = float(fleet.field(long, "admitted_at")) - float(fleet.field(long, "queued_at"))
    assert waited < 1.0 + 1.0, waited  # its 1 s, then the two running short jobs end
    assert ledger.tokens(long) == 900 and ledger.in_use() == 900  # the shorts waited for it


def test_with_the_budget_spent_consumption_pauses_and_resumes(make_fleet):
    port = free_port()
    fleet = make_fleet(workers=0, extra_env={"KVFLEET_SCHEDULER_METRICS_PORT": str(port),
                                             "KVFLEET_MAX_BUFFERED": "4", "KVFLEET_MAX_POLL_RECORDS": "5"})
    fleet.fake_capacity(100)  # no job of 120 tokens fits
    jobs = [submit(fleet, "low", 120) for _ in range(40)]

    def paused() -> dict[str, float]:
        samples = fleet.metrics(port)
        low = {k.split("{")[0]: v for k, v in samples.items() if 'priority="low"' in k}
        return low if low.get("kvfleet_scheduler_paused_partitions") == 1 else {}

    low = fleet.wait_for(paused, "the low partition paused")
    # Bounded: at most max_buffered + one poll held; the rest waits on Kafka, counted as lag.
    assert low["kvfleet_scheduler_buffered_jobs"] <= 4 + 5
    assert low["kvfleet_scheduler_consumer_lag_messages"] == 40
    time.sleep(1.5)
    assert fleet.metrics(port)['kvfleet_scheduler_buffered_jobs{priority="low"}'] <= 9  # it stays so
    fleet.fake_capacity(120 * 40)
    fleet.wait_for(lambda: len(admitted(fleet, jobs)) == 40, "every job admitted after the budget grew")
    fleet.wait_for(lambda: fleet.metrics(port)['kvfleet_scheduler_paused_partitions{priority="low"}'] == 0, "resumed")
    in_use = Ledger(fleet.redis, fleet.keys).in_use()
    assert in_use == 120 * 40 and fleet.metrics(port)["kvfleet_scheduler_budget_in_use_tokens"] <= in_use


def test_a_restarted_scheduler_neither_loses_nor_reserves_twice(make_fleet):
    fleet = make_fleet(workers=0)
    fleet.fake_capacity(1000)
    ledger = Ledger(fleet.redis, fleet.keys)
    tasks = f"{fleet.prefix}.tasks.normal"  # the Celery queue: one entry per task sent
    blocker = submit(fleet, "normal", 500)
    fleet.wait_for(lambda: admitted(fleet, [blocker]), "blocker admitted")
    big = submit(fleet, "normal", 1000)  # waits: its offset holds the partition's commit back
    small = [submit(fleet, "normal", 100) for _ in range(5)]  # admitted past it, not committed
    fleet.wait_for(lambda: len(admitted(fleet, small)) == 5, "small jobs admitted")
    fleet.wait_for(lambda: fleet.redis.llen(tasks) == 6, "their tasks sent")  # just after the admission
    assert ledger.in_use() == 1000
    fleet.kill("scheduler-2", signal.SIGKILL)  # api-1, scheduler-2
    fleet.start("scheduler")
    # The new member gets the partition once the dead one's session expires; it reads
    # `big` and the small jobs again, finds those admitted and sends them again.
    fleet.wait_for(lambda: fleet.redis.llen(tasks) == 11, "admitted jobs sent again after the restart", timeout=60)
    assert ledger.in_use() == 1000 and all(ledger.tokens(j) == 100 for j in small)  # reserved once
    assert fleet.state(big) == "queued"
    for job_id in [blocker, *small]:  # they finish
        ledger.release(job_id)
    fleet.wait_for(lambda: admitted(fleet, [big]), "the waiting job admitted by the new scheduler")
    fleet.wait_for(lambda: fleet.redis.llen(tasks) == 12, "its task sent")
    assert ledger.in_use() == 1000


def test_a_job_waiting_past_its_deadline_expires(make_fleet):
    fleet = make_fleet(workers=0)
    fleet.fake_capacity(100)
    job_id = submit(fleet, "high", 200, timeout_s=1.0)  # never fits
    fleet.wait_for(lambda: fleet.state(job_id) == "expired", "expired", timeout=15)
    result = httpx.get(f"{fleet.url}/v1/jobs/{job_id}", headers={"X-Tenant-ID": "acme"}).json()
    assert result["error"]["code"] == "deadline_passed"


def test_commit_positions_stop_at_the_oldest_undecided_record():
    book, tp = OffsetBook(), TopicPartition("t", 0)
    for offset in range(5):
        book.read(tp, offset)
    for offset in (0, 1, 3, 4):  # offset 2 still buffered
        book.decided(tp, offset)
    assert book.due()[tp].offset == 2
    book.committed(book.due())
    assert book.due() == {}
    book.decided(tp, 2)
    assert book.due()[tp].offset == 5
    book.forget({tp})
    assert book.due() == {} and book.position(tp) is None


def test_policy_knobs_and_tenants_come_from_the_environment():
    settings = Settings.from_env({"KVFLEET_LOW_MAX_WAIT_S": "3", "KVFLEET_LOW_RESERVE_AFTER_S": "1",
                                  "KVFLEET_MAX_BUFFERED": "8"})
    config = policy_config(settings.policy)
    assert config.low.max_wait_s == 3.0 and config.low.share == 0.1 and config.max_buffered == 8
    with pytest.raises(ValueError, match="low.reserve_after_s=10.0 .* KVFLEET_LOW_RESERVE_AFTER_S"):
        policy_config(Settings.from_env({"KVFLEET_LOW_MAX_WAIT_S": "3"}).policy)  # below the default hold
    dev = Tenancy.from_env({})
    assert not dev.configured and dev.get("anyone").share == 1.0
    env = {"KVFLEET_TENANTS": '{"tenants": [{"name": "acme", "tier": "gold", "tokens_per_minute": 60,'
                              ' "api_keys": ["key-acme-1"]}]}'}
    assert Tenancy.from_env(env, {"key-acme-2": "acme"}).keys == {"key-acme-1": "acme", "key-acme-2": "acme"}
    assert Tenancy.from_env(env).get("globex") is None
    with pytest.raises(ValueError, match="exactly one tenant"):
        Tenancy.from_env(env, {"key-acme-1": "globex"})
    with pytest.raises(ValueError, match="does not list"):
        Tenancy.from_env(env, {"key-other": "globex"})
    assert Priority.LOW in settings.api.max_backlog


def test_admission_reserves_once_within_capacity_and_never_for_an_ended_job(redis_client, prefix):
    store, ledger = JobStore(redis_client, Keys(prefix)), Ledger(redis_client, Keys(prefix))
    for job_id in ("a", "b", "c"):
        store.create(JobRequest(job_id=job_id, tenant="acme", priority=Priority.HIGH, model="builtin:tiny",
                                max_new_tokens=4, submitted_at=time.time(), prompt="hi"))

    def admit(*jobs: tuple[str, int], revive: bool = False) -> list[tuple[bool, bool, Optional[str]]]:
        out = store.admit_many([Admit(j, n, "acme", Priority.HIGH, revive) for j, n in jobs], capacity=100,
                               lease_s=60, now=time.time(), by="test")
        return [(a.reserved, a.full, a.previous.value if a.previous else None) for a in out]

    assert admit(("a", 60), ("b", 60)) == [(True, False, "queued"), (False, True, "queued")]  # b: no room
    assert admit(("a", 60)) == [(True, False, "admitted")]  # again: counted once, lease extended
    usage = ledger.usage()  # the ledger reads what admission wrote
    assert usage.in_use == 60 and usage.by_tenant == {"acme": 60} and usage.by_class == {Priority.HIGH: 60}
    store.start("c", now=time.time(), worker="w")  # running without a reservation (reclaimed)
    assert admit(("c", 30)) == [(False, False, "running")]  # a redelivered message: not reserved
    assert admit(("c", 30), revive=True) == [(True, False, "running")]  # its worker died: reserved again
    store.fail("a", JobState.CANCELLED, "cancelled", "by the client", now=time.time())
    assert ledger.tokens("a") is None and admit(("a", 60)) == [(False, False, "cancelled")]
    assert ledger.in_use() == 30 and admit(("nope", 10)) == [(False, False, None)]


class _FlakyStore(JobStore):
    """The job store, failing to record one job as if Redis dropped the connection."""

    def __init__(self, *args, fail_on: str) -> None:
        super().__init__(*args)
        self.fail_on = fail_on

    def create(self, request: JobRequest):
        if request.job_id == self.fail_on:
            raise redis_lib.ConnectionError("connection reset")
        return super().create(request)


class _SeekingConsumer:
    def __init__(self) -> None:
        self.seeks: dict[TopicPartition, int] = {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset


def test_a_redis_error_during_intake_rereads_exactly_the_records_not_yet_taken(redis_client, prefix):
    settings = Settings().replace(kafka=KafkaSettings(topic_prefix=f"{prefix}.requests"),
                                  redis=RedisSettings(key_prefix=prefix))
    store = _FlakyStore(redis_client, Keys(prefix), fail_on="b")
    consumer = _SeekingConsumer()
    service = SchedulerService(settings, consumer, None, SimpleNamespace(store=store), None, None,
                               Tenancy(None), PromptLength("builtin:tiny"))
    topic = settings.kafka.topics[1]  # normal
    jobs = [JobRequest(job_id=j, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny", max_new_tokens=4,
                       submitted_at=time.time(), prompt="hi", prompt_len=3) for j in ("a", "b", "c")]
    store.create(jobs[0])  # "a" came through the API; "b" and "c" were produced directly
    records = [ConsumerRecord(topic, 0, -1, 10 + i, 0, 0, b"acme", encode(j), [], None, 4, 100, 0)
               for i, j in enumerate(jobs)]
    with pytest.raises(redis_lib.ConnectionError):
        service.intake(records)
    tp = TopicPartition(topic, 0)
    assert consumer.seeks == {tp: 11}  # "b" and "c" are read again; "a" is buffered once
    assert list(service.waiting) == ["a"] and service.policy.pending() == 1
    store.fail_on = ""
    service.intake(records[1:])  # the re-read
    assert list(service.waiting) == ["a", "b", "c"] and service.offsets.position(tp) == 10
