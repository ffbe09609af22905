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

from kvfleet import registry
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobState, Priority, WorkerHeartbeat, encode
from kvfleet.jobstore import Admit, JobStore
from kvfleet.kafka import ensure_topics, make_consumer
from kvfleet.ledger import Ledger
from kvfleet.settings import KafkaSettings, RedisSettings, Settings
from kvfleet.tenancy import Tenancy
from scheduler.intake import Tokenize
from scheduler.offsets import OffsetBook
from scheduler.service import SchedulerService
from tests.fleet import Fleet, free_port
from tests.recording_redis import Recording


def submit(fleet: Fleet, priority: str, cost: int, **body) -> str:
    """A job reserving exactly `cost` tokens."""
    return fleet.submit(priority, prompt_len=cost - 8, max_new_tokens=8, **body)


def admitted(fleet: Fleet, job_ids: list[str]) -> list[str]:
    return [j for j in job_ids if fleet.state(j) == "admitted"]


def consumed(fleet: Fleet, port: int) -> float:
    """Records the scheduler has read so far, all classes."""
    return sum(v for k, v in fleet.metrics(port).items() if k.startswith("kvfleet_scheduler_records_consumed_total"))


def test_under_contention_high_is_admitted_before_normal_before_low(make_fleet):
    port = free_port()
    fleet = make_fleet(workers=0, extra_env={"KVFLEET_SCHEDULER_METRICS_PORT": str(port)})
    fleet.fake_capacity(1000)
    blocker = submit(fleet, "normal", 1000)
    fleet.wait_for(lambda: admitted(fleet, [blocker]), "blocker admitted")
    jobs = [submit(fleet, p, 1000) for p in ("low", "normal", "high") for _ in range(3)]
    fleet.wait_for(lambda: consumed(fleet, port) >= 1 + 9, "all read and buffered")
    assert not admitted(fleet, jobs)  # none fits
    order, current = [], blocker
    for _ in jobs:  # play a worker that runs one job at a time
        fleet.finish(current)
        current = fleet.wait_for(lambda: admitted(fleet, [j for j in jobs if j not in order]), "next admission")[0]
        order.append(current)
    assert [jobs.index(j) // 3 for j in order] == [2, 2, 2, 1, 1, 1, 0, 0, 0]  # high, normal, low
    assert order == sorted(order, key=lambda j: (-(jobs.index(j) // 3), jobs.index(j)))  # FIFO within a class


def test_a_long_job_is_not_starved_by_a_stream_of_short_ones(make_fleet):
    # Budget 1000; short jobs of 400 (two at a time) and one long job of 900.
    port = free_port()
    fleet = make_fleet(workers=0, extra_env={"KVFLEET_NORMAL_RESERVE_AFTER_S": "1",
                                             "KVFLEET_SCHEDULER_METRICS_PORT": str(port)})
    fleet.fake_capacity(1000)
    ledger = Ledger(fleet.redis, fleet.keys)
    shorts = [submit(fleet, "normal", 400) for _ in range(2)]
    fleet.wait_for(lambda: len(admitted(fleet, shorts)) == 2, "two short jobs running")
    long = submit(fleet, "normal", 900)
    released: set[str] = set()
    deadline = time.monotonic() + 60  # a starved job would wait forever: this is the failure
    # Play the workers: each round the oldest short job ends and a new one arrives, so
    # without a hold a short one always takes the 600 tokens that free up. A round ends
    # once the scheduler has read the new job, whatever the machine's speed.
    while fleet.state(long) != "admitted":
        assert time.monotonic() < deadline, "starved: short jobs kept taking the tokens it needs"
        running = [j for j in admitted(fleet, shorts) if j not in released]
        if running:
            fleet.finish(running[0])
            released.add(running[0])
        before = consumed(fleet, port)
        shorts.append(submit(fleet, "normal", 400))
        fleet.wait_for(lambda: consumed(fleet, port) > before, "the new short job read")
    waited = float(fleet.field(long, "admitted_at")) - float(fleet.field(long, "queued_at"))
    assert waited >= 1.0  # it fitted only once its hold began, after its reserve_after_s
    assert fleet.reserved(long) == 900 and ledger.in_use() == 900  # the shorts waited for it


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

    def paused_with_everything_produced() -> dict[str, float]:
        # The gauges are sampled once a second: wait for a sample taken after the last
        # submission (lag 40), which the scheduler made with all 40 jobs readable.
        low = paused()
        return low if low.get("kvfleet_scheduler_consumer_lag_messages") == 40 else {}

    low = fleet.wait_for(paused_with_everything_produced, "the low partition paused, all 40 jobs lagging")
    # Bounded: at most max_buffered + one poll held; the rest waits on Kafka, counted as lag.
    assert low["kvfleet_scheduler_buffered_jobs"] <= 4 + 5
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
    assert ledger.in_use() == 1000 and all(fleet.reserved(j) == 100 for j in small)  # reserved once
    assert fleet.state(big) == "queued"
    for job_id in [blocker, *small]:  # they finish
        fleet.finish(job_id)
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
    config = settings.policy
    assert config.low.max_wait_s == 3.0 and config.low.share == 0.1 and config.max_buffered == 8
    with pytest.raises(ValueError, match=r"low.reserve_after_s=10.0 .*\(KVFLEET_LOW_RESERVE_AFTER_S"):
        Settings.from_env({"KVFLEET_LOW_MAX_WAIT_S": "3"})  # below the default hold
    dev = Tenancy.from_settings(Settings.from_env({}))
    assert not dev.configured and dev.get("anyone").share == 1.0
    env = {"KVFLEET_TENANTS": '{"tenants": [{"name": "acme", "tier": "gold", "tokens_per_minute": 60,'
                              ' "api_keys": ["key-acme-1"]}]}'}

    def tenancy(api_keys: str = "") -> Tenancy:
        return Tenancy.from_settings(Settings.from_env({**env, "KVFLEET_API_KEYS": api_keys}))

    assert tenancy("key-acme-2:acme").keys == {"key-acme-1": "acme", "key-acme-2": "acme"}
    assert tenancy().get("globex") is None
    with pytest.raises(ValueError, match="exactly one tenant"):
        tenancy("key-acme-1:globex")
    with pytest.raises(ValueError, match="does not list"):
        tenancy("key-other:globex")
    assert Priority.LOW in settings.api.max_backlog


def test_admission_reserves_once_within_capacity_and_never_for_an_ended_job(redis_client, prefix):
    store, ledger = JobStore(redis_client, Keys(prefix)), Ledger(redis_client, Keys(prefix))

    def reserved(job_id: str) -> Optional[bytes]:
        return redis_client.hget(Keys(prefix).ledger, job_id)

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
    assert reserved("a") is None and admit(("a", 60)) == [(False, False, "cancelled")]
    assert ledger.in_use() == 30 and admit(("nope", 10)) == [(False, False, None)]


class _FlakyStore(JobStore):
    """The job store, failing to record one job as if Redis dropped the connection."""

    def __init__(self, *args, fail_on: str) -> None:
        super().__init__(*args)
        self.fail_on = fail_on

    def create_many(self, requests):
        if any(r.job_id == self.fail_on for r in requests):
            raise redis_lib.ConnectionError("connection reset")
        return super().create_many(requests)


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
                               Tenancy(None), Tokenize("builtin:tiny"))
    topic = settings.kafka.topics[1]  # normal
    jobs = [JobRequest(job_id=j, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny", max_new_tokens=4,
                       submitted_at=time.time(), prompt="hi") for j in ("a", "b", "c")]
    store.create(jobs[0])  # "a" came through the API; "b" and "c" were produced directly
    records = [ConsumerRecord(topic, 0, -1, 10 + i, 0, 0, b"acme", encode(j), [], None, 4, 100, 0)
               for i, j in enumerate(jobs)]
    with pytest.raises(redis_lib.ConnectionError):
        service.intake(records)
    tp = TopicPartition(topic, 0)
    # The poll's new jobs are recorded together, before any is taken: all are read again.
    assert consumer.seeks == {tp: 10}
    assert list(service.waiting) == [] and service.policy.pending() == 0
    assert store.state("b") is None and store.state("c") is None
    store.fail_on = ""
    service.intake(records)  # the re-read
    assert list(service.waiting) == ["a", "b", "c"] and service.policy.pending() == 3
    assert service.offsets.position(tp) == 10 and store.state("c") is JobState.QUEUED


def test_new_records_cost_one_round_trip_for_their_states_and_the_budget(redis_url, prefix):
    # Issue 16: the intake's state read, then the budget's ledger read, cost an idle
    # job's path two round trips one after the other; now one pipeline carries both.
    settings = Settings().replace(kafka=KafkaSettings(topic_prefix=f"{prefix}.requests"),
                                  redis=RedisSettings(key_prefix=prefix))
    client = Recording.from_url(redis_url)
    keys = Keys(prefix)
    store, ledger = JobStore(client, keys), Ledger(client, keys)
    capacity = SimpleNamespace(read=lambda: 10_000, slots=lambda: 0)
    service = SchedulerService(settings, _SeekingConsumer(), None, SimpleNamespace(store=store), ledger, capacity,
                               Tenancy(None), Tokenize("builtin:tiny"))
    held = JobRequest(job_id="held", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny", max_new_tokens=4,
                      submitted_at=time.time(), prompt_tokens=[1, 2, 3])
    store.create(held)
    store.admit_many([Admit("held", 7, "acme", Priority.NORMAL)], capacity=10_000, lease_s=60, now=time.time(), by="s")
    job = JobRequest(job_id="new", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny", max_new_tokens=4,
                     submitted_at=time.time(), prompt_tokens=[1, 2, 3])
    store.create(job)
    record = ConsumerRecord(settings.kafka.topics[1], 0, -1, 5, 0, 0, b"acme", encode(job), [], None, 4, 100, 0)
    client.trips.clear()
    service.intake([record])
    budget = service.budget()
    assert client.trips == [["EVALSHA", "EVALSHA"]]  # the states and the ledger, one pipeline
    assert list(service.waiting) == ["new"]
    assert budget.in_use == 7 and budget.tenant_in_use == {"acme": 7}  # the ledger as it was read
    client.trips.clear()
    assert service.budget().in_use == 7 and client.round_trips == 1  # read once: the next budget reads again


def _service(settings: Settings, consumer) -> SchedulerService:
    return SchedulerService(settings, consumer, None, SimpleNamespace(store=None), None, None, Tenancy(None),
                            Tokenize("builtin:tiny"))


def test_a_rebalance_that_a_short_poll_interrupts_still_ends_in_an_assignment(kafka_bootstrap, prefix):
    # Subscribing right after the topics are created: the first join sees no metadata
    # for them, the next metadata refresh starts a second rebalance, and the scheduler's
    # short polls time out in its middle. kafka-python 3.0.12 then dropped the
    # assignment about every other time (the member stayed revoked for good); the
    # scheduler pins the rejoin so the rebalance completes on a later poll.
    for attempt in range(3):
        kafka = KafkaSettings(bootstrap=kafka_bootstrap, topic_prefix=f"{prefix}{attempt}.requests",
                              group=f"{prefix}{attempt}-scheduler", partitions=2)
        ensure_topics(kafka)
        consumer = make_consumer(kafka, client_id="rebalance-test", max_poll_records=10,
                                 fetch_max_wait_ms=Settings().scheduler.fetch_max_wait_ms)
        try:
            service = _service(Settings().replace(kafka=kafka), consumer)
            service.wait_for_topics()
            consumer.subscribe(kafka.topics, listener=service.revocations)
            revoked_after_assignment = False
            started = time.monotonic()
            # The metadata refresh that starts the second rebalance comes within a
            # second; an attempt assigned and still unrevoked after 5 s has nothing to show.
            quiet_after, deadline = started + 5, started + 60
            while not (revoked_after_assignment and service.revocations.unassigned_for() == 0):
                assert time.monotonic() < deadline, f"attempt {attempt}: no assignment after the rebalance"
                assigned = service.revocations.unassigned_for() == 0
                consumer.poll(timeout_ms=service.settings.scheduler.busy_poll_ms)
                revoked_after_assignment |= assigned and bool(service.revocations.take())
                if not revoked_after_assignment and assigned and time.monotonic() > quiet_after:
                    break
            assert len(consumer.assignment()) == 6
        finally:
            consumer.close()


class _GroupConsumer:
    """Records the consumer calls the membership watchdog makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def unsubscribe(self) -> None:
        self.calls.append("unsubscribe")

    def subscribe(self, topics, listener) -> None:
        self.calls.append("subscribe")


def test_a_member_left_without_partitions_rejoins_then_exits_for_its_supervisor():
    from scheduler.offsets import Revocations
    from scheduler.service import MembershipStalled

    now = [0.0]
    consumer = _GroupConsumer()
    service = _service(Settings(), consumer)
    service.revocations = Revocations(clock=lambda: now[0])
    limit = service.settings.scheduler.rejoin_after_s
    service.revocations.on_partitions_assigned(set())  # an empty assignment is healthy
    now[0] = 10 * limit
    service.check_membership()
    assert consumer.calls == []
    service.revocations.on_partitions_revoked({TopicPartition("t", 0)})  # a rebalance begins ...
    now[0] += limit - 1
    service.check_membership()
    assert consumer.calls == []  # ... and may take its time
    now[0] += 1
    service.check_membership()
    assert consumer.calls == ["unsubscribe", "subscribe"]  # stuck: rejoin from scratch
    now[0] += limit - 1
    service.check_membership()
    assert consumer.calls == ["unsubscribe", "subscribe"]
    now[0] += 1
    with pytest.raises(MembershipStalled):  # rejoining did not help: exit, be restarted
        service.check_membership()
    service.revocations.on_partitions_assigned({TopicPartition("t", 0)})
    service.check_membership()  # an assignment clears it all
    assert not service._rejoined


def test_a_scheduler_evicted_from_its_group_gets_its_partitions_back(make_fleet, kafka_bootstrap):
    from kafka import KafkaAdminClient

    fleet = make_fleet(workers=1)
    first = fleet.submit(max_new_tokens=2)
    fleet.wait_for(lambda: fleet.state(first) == "done", "the first job done")
    group = fleet.env["KVFLEET_SCHEDULER_GROUP"]
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        scheduler = fleet.procs["scheduler-2"]
        scheduler.send_signal(signal.SIGSTOP)  # frozen: no heartbeats, the session expires
        try:
            fleet.wait_for(lambda: not admin.describe_groups([group])[group]["members"],
                           "the group's coordinator evicted the frozen member", timeout=120)
            waiting = fleet.submit(max_new_tokens=2)  # on a partition nobody owns now
        finally:
            scheduler.send_signal(signal.SIGCONT)
        fleet.wait_for(lambda: fleet.state(waiting) == "done", "the waiting job done after the rejoin", timeout=120)
        assert len(admin.describe_groups([group])[group]["members"]) == 1
    finally:
        admin.close()


def test_normal_jobs_leave_the_reserved_slots_to_high(make_fleet):
    # Four slots, half kept for high (KVFLEET_HIGH_SLOT_RESERVE): normal jobs take two.
    port = free_port()
    fleet = make_fleet(workers=0, extra_env={"KVFLEET_HIGH_SLOT_RESERVE": "0.5",
                                             "KVFLEET_SCHEDULER_METRICS_PORT": str(port)})
    registry.publish(fleet.redis, fleet.keys, WorkerHeartbeat("fake", 10_000, slots=4), ttl_ms=600_000)
    normal = [submit(fleet, "normal", 100) for _ in range(4)]
    fleet.wait_for(lambda: consumed(fleet, port) >= 4 and len(admitted(fleet, normal)) == 2, "two normal admitted")
    high = submit(fleet, "high", 100)
    fleet.wait_for(lambda: admitted(fleet, [high]), "the high job admitted into a reserved slot")
    assert len(admitted(fleet, normal)) == 2  # tokens for all, but the other two slots stay high's
    for j in admitted(fleet, normal):
        fleet.finish(j)
    # One slot taken (the high job), three free: one more normal job, the last two kept.
    fleet.wait_for(lambda: len(admitted(fleet, normal)) == 1, "one more normal admitted")
    assert sum(fleet.state(j) == "queued" for j in normal) == 1
    assert Ledger(fleet.redis, fleet.keys).usage().jobs == 2
