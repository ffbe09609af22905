"""The job store on the real Redis: one-way states, idempotent create, atomic finish."""

from __future__ import annotations

import time

import pytest

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Usage, Timings
from kvfleet.jobstore import JobStore
from kvstore.lock import Lease


def _job(job_id: str = "j1", tenant: str = "acme") -> JobRequest:
    return JobRequest(job_id=job_id, tenant=tenant, priority=Priority.HIGH, model="builtin:tiny",
                      max_new_tokens=4, submitted_at=time.time(), prompt="hi")


@pytest.fixture
def store(redis_client, prefix) -> JobStore:
    return JobStore(redis_client, Keys(prefix))


def _done(job: JobRequest) -> JobResult:
    return JobResult(job_id=job.job_id, status=JobState.DONE, tenant=job.tenant, priority=job.priority,
                     text="ok", tokens=[1, 2], usage=Usage(1, 2, 0), timings=Timings(finished_at=time.time()))


def test_create_is_idempotent(store):
    job = _job()
    assert store.create(job) == (True, JobState.QUEUED, "acme")
    assert store.create(_job(tenant="other")) == (False, JobState.QUEUED, "acme")
    assert store.request(job.job_id) == job
    assert store.get(job.job_id).status is JobState.QUEUED


def test_states_move_one_way(store):
    job = _job()
    store.create(job)
    assert store.transition(job.job_id, JobState.ADMITTED, admitted_at=1.0).ok
    assert not store.transition(job.job_id, JobState.QUEUED).ok  # never backwards
    assert store.start(job.job_id, now=2.0, worker="w").ok
    assert store.finish(_done(job)).ok
    second = store.finish(_done(job))
    assert not second.ok and second.previous == "done"  # a duplicate finish changes nothing
    assert not store.transition(job.job_id, JobState.RUNNING).ok
    assert store.get(job.job_id).text == "ok"


def test_finish_releases_the_reservation_atomically(store, redis_client):
    job = _job()
    store.create(job)
    redis_client.hset(store.keys.ledger, job.job_id, 100)
    redis_client.zadd(store.keys.ledger_leases, {job.job_id: time.time() + 60})
    store.start(job.job_id, now=1.0, worker="w")
    assert store.finish(_done(job)).ok
    assert redis_client.hget(store.keys.ledger, job.job_id) is None
    assert redis_client.zscore(store.keys.ledger_leases, job.job_id) is None


def test_only_the_lease_holder_writes_the_result(store, redis_client):
    job = _job()
    store.create(job)
    store.start(job.job_id, now=1.0, worker="w")
    mine = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    assert mine.acquire()
    stale = store.finish(_done(job), lease_token="someone-else")
    assert not stale.ok and stale.previous == "lease_lost"
    assert store.finish(_done(job), lease_token=mine.token).ok


def test_a_runner_whose_lease_expired_unclaimed_still_keeps_its_result(store, redis_client):
    # The runner stalled past its lease, but no other copy took the job over: throwing
    # the finished result away would only make the job run again.
    job = _job()
    store.create(job)
    store.start(job.job_id, now=time.time(), worker="w")
    mine = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    assert mine.acquire()
    redis_client.delete(store.keys.run_lease(job.job_id))  # expired
    assert store.finish(_done(job), lease_token=mine.token).ok
    assert store.get(job.job_id).status is JobState.DONE


def test_fail_records_error_and_timings(store):
    job = _job()
    store.create(job)
    assert store.fail(job.job_id, JobState.EXPIRED, "deadline_passed", "too late", now=5.0).ok
    result = store.get(job.job_id)
    assert result.status is JobState.EXPIRED and result.error.code == "deadline_passed"
    assert result.timings.finished_at == 5.0 and result.timings.queued_at == pytest.approx(job.submitted_at)


def test_finished_jobs_expire(store, redis_client):
    job = _job()
    store.create(job)
    assert 0 < redis_client.ttl(store.keys.job(job.job_id)) <= 7 * 24 * 3600
    store.fail(job.job_id, JobState.FAILED, "x", "y", now=1.0)
    assert 0 < redis_client.ttl(store.keys.job(job.job_id)) <= 24 * 3600
