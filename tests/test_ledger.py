"""The token ledger on the real Redis: reservations made by admission (atomic, shared by
replicas, counted once), leases renewed and reclaimed, and the release a job's finish
performs. Reservations are made the one way production makes them, `JobStore.admit_many`."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import redis as redis_lib

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Timings
from kvfleet.jobstore import Admit, JobStore
from kvfleet.ledger import Ledger

CAPACITY = 10_000


def _create(store: JobStore, *job_ids: str) -> None:
    for job_id in job_ids:
        store.create(JobRequest(job_id=job_id, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                                max_new_tokens=16, submitted_at=time.time(), prompt_tokens=[1, 2, 3]))


def _admit(store: JobStore, *jobs: tuple[str, int], lease_s: float = 60.0, tenant: str = "acme",
           priority: Priority = Priority.NORMAL) -> list[bool]:
    """Admit the (job id, tokens) in order, as the scheduler does; which were reserved."""
    out = store.admit_many([Admit(job_id, tokens, tenant, priority) for job_id, tokens in jobs],
                           capacity=CAPACITY, lease_s=lease_s, now=time.time(), by="test")
    return [a.reserved for a in out]


def _grab(url: str, prefix: str, worker: int, n: int, out, start, ready=None) -> None:
    """Admit n jobs of random sizes once `start` is set; report what was granted."""
    store = JobStore(redis_lib.Redis.from_url(url), Keys(prefix))
    rng = random.Random(worker)
    jobs = [(f"w{worker}-{i}", rng.randint(100, 900)) for i in range(n)]
    _create(store, *(job_id for job_id, _ in jobs))  # connects and loads the scripts before the race
    if ready is not None:
        ready.put(worker)
    granted = {}
    start.wait(60)
    for job_id, tokens in jobs:
        if _admit(store, (job_id, tokens)) == [True]:
            granted[job_id] = tokens
    out.put(granted)


def _assert_never_over(ledger: Ledger, granted: dict[str, int]) -> None:
    assert sum(granted.values()) == ledger.in_use() <= CAPACITY
    assert ledger.in_use() > CAPACITY - 900  # contended: it filled up, then refused


def test_admission_reserves_within_capacity_and_an_end_frees(redis_client, prefix):
    store, ledger = JobStore(redis_client, Keys(prefix)), Ledger(redis_client, Keys(prefix))
    _create(store, "a", "b", "c")
    assert _admit(store, ("a", 6_000), ("b", 5_000), ("c", 4_000)) == [True, False, True]  # b: 11k > 10k
    assert ledger.in_use() == CAPACITY  # exactly full
    assert store.fail("a", JobState.CANCELLED, "cancelled", "by the client", now=time.time()).ok
    assert ledger.in_use() == 4_000 and redis_client.hget(Keys(prefix).ledger, "a") is None


def test_a_reservation_counts_once_per_job(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "a")
    assert _admit(store, ("a", 6_000), lease_s=100.0) == [True]
    first = redis_client.zscore(keys.ledger_leases, "a")
    # Admitted again (a redelivery): still granted, counted once, even at a capacity it
    # would not fit in twice; and its lease is extended, never shortened.
    assert _admit(store, ("a", 6_000), lease_s=10.0) == [True]
    assert ledger.in_use() == 6_000 and redis_client.zscore(keys.ledger_leases, "a") == first
    assert _admit(store, ("a", 6_000), lease_s=200.0) == [True]
    assert 99.0 < redis_client.zscore(keys.ledger_leases, "a") - first < 130.0


def test_no_over_admission_from_concurrent_threads(redis_url, prefix):
    out, start = _Collect(), threading.Event()
    threads = [threading.Thread(target=_grab, args=(redis_url, prefix, w, 60, out, start)) for w in range(8)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join()
    _assert_never_over(Ledger(redis_lib.Redis.from_url(redis_url), Keys(prefix)), out.merged())


def test_no_over_admission_from_two_processes(redis_url, prefix):
    ctx = multiprocessing.get_context("spawn")
    queue, start, ready = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_grab, args=(redis_url, prefix, w, 150, queue, start, ready)) for w in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)  # both imported and connected: they race from the same instant
    start.set()
    granted = {}
    for _ in procs:
        granted.update(queue.get(timeout=60))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    _assert_never_over(Ledger(redis_lib.Redis.from_url(redis_url), Keys(prefix)), granted)


def test_reclaim_hands_out_expired_leases_only_and_keeps_the_reservation(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "dead", "alive")
    assert _admit(store, ("dead", 1_000), ("alive", 2_000), lease_s=10.0) == [True, True]
    until = redis_client.zscore(keys.ledger_leases, "dead")  # both: admitted in one call
    assert ledger.renew("alive", 60.0, now=until - 5)  # its worker keeps renewing
    assert ledger.reclaim_expired(30.0, now=until - 0.1) == []
    assert ledger.reclaim_expired(30.0, now=until + 1) == ["dead"]
    # Handed out, not freed: the reservation is the job's only durable pointer.
    assert ledger.in_use() == 3_000 and sorted(redis_client.hkeys(keys.ledger_meta)) == [b"alive", b"dead"]
    assert redis_client.zscore(keys.ledger_leases, "dead") == until + 31
    assert ledger.reclaim_expired(30.0, now=until + 1) == []  # one caller per lease


def test_a_reclaimed_job_whose_resend_was_lost_is_reclaimed_again(redis_client, prefix):
    """Issue 13 #2: the scheduler that reclaimed a job crashed (or hit a Redis error)
    before it sent the job again. The job must not be lost with that scheduler's memory."""
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "orphan")
    _admit(store, ("orphan", 500), lease_s=10.0)
    until = redis_client.zscore(keys.ledger_leases, "orphan")
    assert ledger.reclaim_expired(20.0, now=until + 1) == ["orphan"]  # ... and the caller dies here
    assert ledger.reclaim_expired(20.0, now=until + 20) == []
    assert ledger.reclaim_expired(20.0, now=until + 22) == ["orphan"]  # the next one takes it
    assert ledger.in_use() == 500


def test_release_drops_a_reservation_whose_job_is_gone(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "gone")
    _admit(store, ("gone", 500))
    assert ledger.release("gone") and not ledger.release("gone")
    assert ledger.in_use() == 0 and redis_client.zcard(keys.ledger_leases) == 0


def test_reclaim_uses_redis_time_by_default(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "short", "long")
    _admit(store, ("short", 1_000), lease_s=0.2)
    _admit(store, ("long", 1_000), lease_s=60.0)
    short_until = redis_client.zscore(keys.ledger_leases, "short")
    deadline = time.monotonic() + 30
    while _redis_now(redis_client) <= short_until:  # the lease runs out on Redis's clock, not ours
        assert time.monotonic() < deadline, "Redis's clock did not pass the lease"
        time.sleep(0.01)
    assert ledger.reclaim_expired(60.0) == ["short"]


def _redis_now(client: redis_lib.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_usage_splits_by_tenant_and_class(redis_client, prefix):
    store, ledger = JobStore(redis_client, Keys(prefix)), Ledger(redis_client, Keys(prefix))
    _create(store, "a", "b", "c")
    _admit(store, ("a", 1_000), tenant="acme", priority=Priority.HIGH)
    _admit(store, ("b", 2_000), tenant="acme", priority=Priority.LOW)
    _admit(store, ("c", 4_000), tenant="globex", priority=Priority.LOW)
    usage = ledger.usage()
    assert usage.in_use == 7_000
    assert usage.by_tenant == {"acme": 3_000, "globex": 4_000}
    assert usage.by_class == {Priority.HIGH: 1_000, Priority.LOW: 6_000}
    assert usage.by_tenant_class == {("acme", Priority.HIGH): 1_000, ("acme", Priority.LOW): 2_000,
                                     ("globex", Priority.LOW): 4_000}


def test_job_store_finish_releases_the_reservation(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    _create(store, "job-1", "job-2")
    assert _admit(store, ("job-1", 500), ("job-2", 700)) == [True, True]
    assert store.start("job-1", now=time.time(), worker="w").ok

    done = JobResult(job_id="job-1", status=JobState.DONE, tenant="acme", priority=Priority.NORMAL,
                     text="hi", timings=Timings(finished_at=time.time()))
    assert store.finish(done).ok

    assert redis_client.hget(keys.ledger, "job-1") is None and ledger.in_use() == 700
    assert redis_client.zscore(keys.ledger_leases, "job-1") is None
    assert redis_client.hkeys(keys.ledger_meta) == [b"job-2"]  # all three entries, at once
    assert ledger.usage().by_tenant == {"acme": 700}
    assert ledger.reclaim_expired(60.0) == []  # nothing left to reclaim for it


class _Collect:
    """A queue-like sink the threads share (a list append is atomic in CPython)."""

    def __init__(self) -> None:
        self.parts: list[dict[str, int]] = []

    def put(self, part: dict[str, int]) -> None:
        self.parts.append(part)

    def merged(self) -> dict[str, int]:
        return {k: v for part in self.parts for k, v in part.items()}
