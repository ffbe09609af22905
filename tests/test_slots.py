"""Capacity counts job slots as well as KV tokens (issue 13 #5).

A worker runs at most as many jobs as it has Celery task threads. Counting only tokens,
a fleet with tokens to spare admitted every job at once; the extra ones waited in the
Celery queue past their admission lease, were reclaimed and sent again while still
queued, and the duplicates waited in the runner's claim loop without limit, each holding
a task thread. Here: slots in heartbeats, in the policy, in the atomic admission, and a
bounded wait for a duplicate; then the whole path through a real fleet.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvfleet import registry
from kvfleet.capacity import FleetCapacity
from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, Priority, WorkerHeartbeat, to_builtins
from kvfleet.jobstore import Admit, JobStore
from kvfleet.ledger import Ledger
from kvstore.lock import Lease
from kvfleet.tenancy import Tier
from scheduler.policy import Budget, PendingJob, Policy
from workers.runner import JobRunner


def _request(job_id: str, *, prompt: int = 3, new: int = 4) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                      max_new_tokens=new, submitted_at=time.time(), prompt_tokens=[1] * prompt)


def test_heartbeats_sum_slots_and_an_unreporting_worker_lifts_the_limit(redis_client, prefix):
    keys = Keys(prefix)
    for name, slots in (("w1", 4), ("w2", 8)):
        registry.publish(redis_client, keys, WorkerHeartbeat(name, 10_000, slots=slots), ttl_ms=10_000)
    capacity = FleetCapacity(redis_client, keys, cache_s=0.0)
    assert (capacity.read(), capacity.slots()) == (20_000, 12)
    registry.publish(redis_client, keys, WorkerHeartbeat("old", 10_000), ttl_ms=10_000)  # no slots field
    assert capacity.slots() == 0  # unknown: tokens alone decide, as before


def test_admission_is_atomic_on_slots_and_a_resend_still_goes(redis_client, prefix):
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    for j in ("a", "b", "c"):
        store.create(_request(j))

    def admit(*job_ids: str) -> list[bool]:
        out = store.admit_many([Admit(j, 10, "acme", Priority.NORMAL) for j in job_ids], capacity=10_000,
                               lease_s=60, now=time.time(), by="t", max_jobs=2)
        return [a.reserved for a in out]

    assert admit("a", "b", "c") == [True, True, False]  # tokens would fit all three
    assert admit("a") == [True]  # already reserved: a resend never counts twice
    usage = Ledger(redis_client, keys).usage()
    assert (usage.jobs, usage.in_use) == (2, 20)


def test_policy_admits_only_into_free_slots():
    policy = Policy()
    now = time.time()
    for i in range(5):
        policy.add(PendingJob(f"j{i}", "acme", Tier.SILVER, Priority.NORMAL, 4, 4, now, None, 0))
    decision = policy.schedule(now, Budget(capacity=10**6, in_use=0, slots=3, jobs=1))
    assert len(decision.admit) == 2 and policy.pending() == 3
    assert len(policy.schedule(now, Budget(capacity=10**6, in_use=0, slots=3, jobs=3)).admit) == 0
    assert len(policy.schedule(now, Budget(capacity=10**6, in_use=0)).admit) == 3  # no slot limit


class _NeverCalled:
    def generate(self, *args, **kwargs):
        raise AssertionError("a duplicate must not run the job")

    def cancel(self, request_id: str) -> bool:
        return False


def test_a_duplicate_gives_up_on_a_live_copy_within_two_leases(redis_client, prefix):
    keys = Keys(prefix)
    store = JobStore(redis_client, keys)
    job = _request("busy")
    store.create(job)
    holder = Lease(redis_client, keys.run_lease("busy"), 300)  # another copy, alive and renewing
    assert holder.acquire()
    holder.keep_alive()
    try:
        runner = JobRunner(store, redis_client, _NeverCalled(), tokenizer=None, worker_id="dup", lease_s=0.3,
                           poll_s=0.05)
        started = time.monotonic()
        outcome = runner.run(to_builtins(job))
        assert outcome.label == "duplicate"
        assert time.monotonic() - started < 30  # bounded (two leases); before, it waited for ever
        assert store.state("busy").value == "queued"  # left to the copy that runs it
    finally:
        holder.release()


@pytest.mark.timeout(300)
def test_the_fleet_never_reserves_more_jobs_than_its_workers_have_threads(make_fleet):
    """One worker with two task threads and tokens for dozens of jobs: at no moment are
    more than two jobs reserved, no job is reclaimed or sent twice, all of them finish."""
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_WORKER_CONCURRENCY": "2",
                                              "KVFLEET_ENGINE_MAX_NUM_SEQS": "2"})
    most, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            most[0] = max(most[0], fleet.redis.hlen(fleet.keys.ledger))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    jobs = [fleet.submit("normal", prompt_len=8, max_new_tokens=24) for _ in range(12)]
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in jobs), "all 12 jobs done", timeout=240)
    stop.set()
    sampler.join()
    assert most[0] <= 2, f"{most[0]} jobs reserved at once with 2 slots"
    assert all(fleet.field(j, "attempts") == "1" for j in jobs)
