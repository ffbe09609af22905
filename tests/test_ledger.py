"""The token ledger on the real Redis: atomic reservations shared by replicas, leases,
and the release a worker's finish performs through the job store."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import redis as redis_lib

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Timings
from kvfleet.jobstore import JobStore
from scheduler.ledger import Ledger

CAPACITY = 10_000


def _grab(url: str, prefix: str, worker: int, n: int, out, start) -> None:
    """Reserve n jobs of random sizes once `start` is set; report what was granted."""
    ledger = Ledger(redis_lib.Redis.from_url(url), Keys(prefix))
    ledger.in_use()  # connect and load the scripts before the race starts
    rng = random.Random(worker)
    granted = {}
    start.wait(30)
    for i in range(n):
        job_id, tokens = f"w{worker}-{i}", rng.randint(100, 900)
        if ledger.reserve(job_id, tokens, 60.0, CAPACITY):
            granted[job_id] = tokens
    out.put(granted)


def _assert_never_over(ledger: Ledger, granted: dict[str, int]) -> None:
    assert sum(granted.values()) == ledger.in_use() <= CAPACITY
    assert ledger.in_use() > CAPACITY - 900  # contended: it filled up, then refused


def test_reserve_counts_and_release_frees(redis_client, prefix):
    ledger = Ledger(redis_client, Keys(prefix))
    assert ledger.reserve("a", 6_000, 60.0, CAPACITY)
    assert not ledger.reserve("b", 5_000, 60.0, CAPACITY)  # 11k > 10k
    assert ledger.reserve("c", 4_000, 60.0, CAPACITY)  # exactly full
    assert ledger.in_use() == CAPACITY
    assert ledger.release("a") and not ledger.release("a")
    assert ledger.in_use() == 4_000 and ledger.tokens("a") is None


def test_reserve_is_idempotent_per_job(redis_client, prefix):
    ledger = Ledger(redis_client, Keys(prefix))
    assert ledger.reserve("a", 6_000, 100.0, CAPACITY, now=1_000.0)
    # A redelivery of the same job: still granted, counted once, even at a capacity
    # it would not fit in twice; and its lease is extended, never shortened.
    assert ledger.reserve("a", 6_000, 10.0, CAPACITY, now=1_000.0)
    assert ledger.in_use() == 6_000
    assert redis_client.zscore(Keys(prefix).ledger + ":leases", "a") == 1_100.0
    assert ledger.reserve("a", 6_000, 200.0, CAPACITY, now=1_000.0)
    assert redis_client.zscore(Keys(prefix).ledger + ":leases", "a") == 1_200.0


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
    queue, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_grab, args=(redis_url, prefix, w, 150, queue, start)) for w in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let both import and connect, so they race from the same instant
    start.set()
    granted = {}
    for _ in procs:
        granted.update(queue.get(timeout=60))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    _assert_never_over(Ledger(redis_lib.Redis.from_url(redis_url), Keys(prefix)), granted)


def test_reclaim_frees_expired_leases_only(redis_client, prefix):
    ledger = Ledger(redis_client, Keys(prefix))
    ledger.reserve("dead", 1_000, 10.0, CAPACITY, now=100.0)
    ledger.reserve("alive", 2_000, 10.0, CAPACITY, now=100.0)
    assert ledger.renew("alive", 60.0, now=105.0)  # its worker keeps renewing
    assert ledger.reclaim_expired(now=109.9) == []
    assert ledger.reclaim_expired(now=111.0) == ["dead"]
    assert ledger.in_use() == 2_000
    assert not ledger.renew("dead", 60.0, now=111.0)  # reclaimed: its worker learns it
    assert ledger.reclaim_expired(now=111.0) == []


def test_reclaim_uses_redis_time_by_default(redis_client, prefix):
    ledger = Ledger(redis_client, Keys(prefix))
    ledger.reserve("short", 1_000, 0.2, CAPACITY)
    ledger.reserve("long", 1_000, 60.0, CAPACITY)
    time.sleep(0.3)
    assert ledger.reclaim_expired() == ["short"]


def test_usage_splits_by_tenant_and_class(redis_client, prefix):
    ledger = Ledger(redis_client, Keys(prefix))
    ledger.reserve("a", 1_000, 60.0, CAPACITY, tenant="acme", priority=Priority.HIGH)
    ledger.reserve("b", 2_000, 60.0, CAPACITY, tenant="acme", priority=Priority.LOW)
    ledger.reserve("c", 4_000, 60.0, CAPACITY, tenant="globex", priority=Priority.LOW)
    usage = ledger.usage()
    assert usage.in_use == 7_000
    assert usage.by_tenant == {"acme": 3_000, "globex": 4_000}
    assert usage.by_class == {Priority.HIGH: 1_000, Priority.LOW: 6_000}


def test_job_store_finish_releases_the_reservation(redis_client, prefix):
    keys = Keys(prefix)
    store, ledger = JobStore(redis_client, keys), Ledger(redis_client, keys)
    request = JobRequest(job_id="job-1", tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                         max_new_tokens=16, submitted_at=time.time(), prompt="hello")
    store.create(request)
    assert ledger.reserve("job-1", 500, 60.0, CAPACITY, tenant="acme", priority=Priority.NORMAL)
    ledger.reserve("job-2", 700, 60.0, CAPACITY, tenant="acme", priority=Priority.NORMAL)
    assert store.transition("job-1", JobState.ADMITTED).ok and store.transition("job-1", JobState.RUNNING).ok

    done = JobResult(job_id="job-1", status=JobState.DONE, tenant="acme", priority=Priority.NORMAL,
                     text="hi", timings=Timings(finished_at=time.time()))
    assert store.finish(done).ok

    assert ledger.tokens("job-1") is None and ledger.in_use() == 700
    assert redis_client.zscore(keys.ledger + ":leases", "job-1") is None
    assert ledger.usage().by_tenant == {"acme": 700}  # its meta entry no longer counts
    assert ledger.reclaim_expired() == []  # nothing left to reclaim for it
    assert redis_client.hkeys(keys.ledger + ":meta") == [b"job-2"]  # and its meta was swept


class _Collect:
    """A queue-like sink the threads share (a list append is atomic in CPython)."""

    def __init__(self) -> None:
        self.parts: list[dict[str, int]] = []

    def put(self, part: dict[str, int]) -> None:
        self.parts.append(part)

    def merged(self) -> dict[str, int]:
        return {k: v for part in self.parts for k, v in part.items()}
