"""The job store on the real Redis: one-way states, idempotent create, atomic finish."""

from __future__ import annotations

import time

import pytest

from kvfleet.constants import Keys
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Usage, Timings
from kvfleet.jobstore import JobStore
from kvstore.lock import Lease
from tests.recording_redis import Recording


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


def test_create_many_is_create_for_each_job_in_one_round_trip(store):
    store.create(_job("old", tenant="first"))
    made = store.create_many([_job("new1"), _job("old", tenant="other"), _job("new2", tenant="beta")])
    assert made == [(True, JobState.QUEUED, "acme"), (False, JobState.QUEUED, "first"), (True, JobState.QUEUED, "beta")]
    assert store.request("new2").tenant == "beta" and store.request("old").tenant == "first"  # the first stands
    assert store.states(["new1", "old", "new2"]) == [JobState.QUEUED] * 3


def test_states_reads_every_job_in_one_command(redis_url, prefix):
    client = Recording.from_url(redis_url)
    store = JobStore(client, Keys(prefix))
    for job in (_job("a"), _job("b")):
        store.create(job)
    store.transition("b", JobState.ADMITTED, admitted_at=1.0)
    store.states(["a"])  # loads the script: its first call may take a SCRIPT LOAD and two EVALSHAs
    client.trips.clear()
    assert store.states(["a", "nobody", "b"]) == [JobState.QUEUED, None, JobState.ADMITTED]
    assert client.sent == ["EVALSHA"]  # not an HGET per job
    assert store.states([]) == [] and client.sent == ["EVALSHA"]


def test_states_of_more_jobs_than_one_call_takes_come_in_order(store, monkeypatch):
    import kvfleet.jobstore

    monkeypatch.setattr(kvfleet.jobstore, "STATES_PER_CALL", 2)
    for job_id in ("a", "c", "e"):
        store.create(_job(job_id))
    assert store.states(["a", "b", "c", "d", "e"]) == [JobState.QUEUED, None, JobState.QUEUED, None, JobState.QUEUED]


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


def _begin(store, job_id, lease, *, now=10.0, deadline=None):
    return store.begin(job_id, lease_token=lease.token, lease_ms=lease.ttl_ms, now=now, worker="w",
                       reservation_lease_s=30.0, deadline=deadline)


def test_begin_takes_the_lease_starts_the_run_and_renews_the_reservation(store, redis_client):
    job = _job()
    store.create(job)
    assert store.transition(job.job_id, JobState.ADMITTED, admitted_at=3.0).ok
    redis_client.hset(store.keys.ledger, job.job_id, 100)
    redis_client.zadd(store.keys.ledger_leases, {job.job_id: 1.0})  # the admission lease, about to run out
    lease = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    begun = _begin(store, job.job_id, lease)
    assert (begun.outcome, begun.previous, begun.attempt) == ("started", "admitted", 1)
    assert begun.timings.admitted_at == 3.0 and begun.timings.queued_at == pytest.approx(job.submitted_at)
    assert redis_client.get(store.keys.run_lease(job.job_id)).decode() == lease.token
    assert store.get(job.job_id).status is JobState.RUNNING and store.field(job.job_id, "worker") == "w"
    assert redis_client.zscore(store.keys.ledger_leases, job.job_id) > time.time() + 20  # the run lease's now


def test_begin_refuses_a_held_lease_a_finished_job_and_a_missing_one(store, redis_client):
    job = _job()
    store.create(job)
    first = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    second = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    assert _begin(store, job.job_id, first).outcome == "started"
    held = _begin(store, job.job_id, second)
    assert (held.outcome, held.previous) == ("held", "running")
    assert store.field(job.job_id, "attempts") == "1"  # a refused copy counts no attempt
    assert store.finish(_done(job), lease_token=first.token).ok
    assert redis_client.get(store.keys.run_lease(job.job_id)) is None  # released with the result
    done = _begin(store, job.job_id, second)
    assert (done.outcome, done.previous) == ("terminal", "done")
    assert redis_client.get(store.keys.run_lease(job.job_id)) is None  # a finished job is not leased
    assert _begin(store, "nope", second).outcome == "missing"


def test_begin_after_the_deadline_leases_the_job_but_does_not_start_it(store, redis_client):
    job = _job()
    store.create(job)
    lease = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    begun = _begin(store, job.job_id, lease, now=10.0, deadline=9.0)
    assert (begun.outcome, begun.previous) == ("expired", "queued")
    assert store.get(job.job_id).status is JobState.QUEUED and store.field(job.job_id, "attempts") == "0"
    assert store.fail(job.job_id, JobState.EXPIRED, "deadline_passed", "late", now=10.0, lease_token=lease.token).ok


def test_begin_again_after_a_dead_runner_counts_the_next_attempt(store, redis_client):
    job = _job()
    store.create(job)
    dead = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    assert _begin(store, job.job_id, dead).attempt == 1
    redis_client.delete(store.keys.run_lease(job.job_id))  # its lease ran out
    again = _begin(store, job.job_id, Lease(redis_client, store.keys.run_lease(job.job_id), 5000))
    assert (again.outcome, again.previous, again.attempt) == ("started", "running", 2)


def test_finish_leaves_a_lease_it_does_not_hold(store, redis_client):
    job = _job()
    store.create(job)
    store.start(job.job_id, now=1.0, worker="w")
    other = Lease(redis_client, store.keys.run_lease(job.job_id), 5000)
    assert other.acquire()
    assert store.finish(_done(job)).ok  # no token: the API's cancel, say
    assert redis_client.get(store.keys.run_lease(job.job_id)).decode() == other.token


def test_finish_announces_a_released_reservation_and_wakes_a_waiting_scheduler(store, redis_client):
    from scheduler.wake import BudgetWake

    wake = BudgetWake(redis_client, store.keys.ledger_freed)
    wake.wait(0)  # subscribed
    unreserved, reserved = _job("u1"), _job("r1")
    for job in (unreserved, reserved):
        store.create(job)
        store.start(job.job_id, now=1.0, worker="w")  # done only from running
    redis_client.hset(store.keys.ledger, reserved.job_id, 100)
    redis_client.zadd(store.keys.ledger_leases, {reserved.job_id: time.time() + 60})
    assert store.finish(_done(unreserved)).ok  # nothing released: nothing announced
    assert store.finish(_done(reserved)).ok
    # Returns as soon as the release arrives (the timeout only bounds a broken test).
    assert wake.wait(30) == 1
    wake.close()


def test_begin_many_is_begin_for_each_job_in_one_round_trip(store, redis_client):
    from kvfleet.jobstore import BeginArgs

    fresh, done, held = _job("fresh"), _job("done"), _job("held")
    for job in (fresh, done, held):
        store.create(job)
    store.start(done.job_id, now=1.0, worker="w")
    assert store.finish(_done(done)).ok
    other = Lease(redis_client, store.keys.run_lease(held.job_id), 5000)
    assert other.acquire()  # another copy runs it
    begun = store.begin_many([BeginArgs(j, f"token-{j}") for j in ("fresh", "done", "held", "nobody")],
                             lease_ms=5000, now=2.0, worker="w2", reservation_lease_s=5.0)
    assert [b.outcome for b in begun] == ["started", "terminal", "held", "missing"]
    assert begun[0].attempt == 1 and begun[0].timings.queued_at == fresh.submitted_at
    assert store.state("fresh") is JobState.RUNNING
    assert redis_client.get(store.keys.run_lease("fresh")).decode() == "token-fresh"
    assert redis_client.get(store.keys.run_lease("held")).decode() == other.token  # untouched
    assert store.begin_many([], lease_ms=5000, now=2.0, worker="w2", reservation_lease_s=5.0) == []


def test_finish_many_is_finish_for_each_result_in_one_round_trip(store, redis_client):
    from kvfleet.jobstore import BeginArgs

    mine, lost, again = _job("mine"), _job("lost"), _job("again")
    for job in (mine, lost, again):
        store.create(job)
    store.begin_many([BeginArgs(j.job_id, f"token-{j.job_id}") for j in (mine, lost, again)],
                     lease_ms=5000, now=2.0, worker="w", reservation_lease_s=5.0)
    redis_client.set(store.keys.run_lease("lost"), "another copy's")  # it took the job over
    assert store.finish(_done(again)).ok  # terminal already: a second result is refused
    written = store.finish_many([(_done(j), f"token-{j.job_id}") for j in (mine, lost, again)])
    assert [w.ok for w in written] == [True, False, False]
    assert [w.previous for w in written] == ["running", "lease_lost", "done"]
    assert store.state("mine") is JobState.DONE and store.state("lost") is JobState.RUNNING
    assert not redis_client.exists(store.keys.run_lease("mine"))  # released with the result
    assert store.finish_many([]) == []


class _ScriptedPubSub:
    """A pub/sub whose `get_message` returns the next scripted message (None: nothing
    arrived within the timeout), then None for ever."""

    def __init__(self, script):
        self.script = list(script)

    def subscribe(self, channel):
        pass

    def get_message(self, timeout=0.0):
        return self.script.pop(0) if self.script else None

    def close(self):
        pass


def test_a_wake_up_gathers_the_releases_that_follow_the_first():
    from scheduler.wake import BudgetWake

    release = {"type": "message", "data": b"j"}

    def wake_after(script) -> BudgetWake:
        client = type("Client", (), {"pubsub": lambda self, **_: _ScriptedPubSub(script)})()
        return BudgetWake(client, "freed")

    # One release, then nothing pending at once, then a second one a moment later.
    script = [release, None, release]
    assert wake_after(script).wait(30) == 1  # without gathering: the wake-up is the first alone
    assert wake_after(script).wait(30, gather_s=0.05) == 2  # gathered into one wake-up
    assert wake_after([]).wait(0.01, gather_s=0.05) == 0  # no release: the timeout, no gathering
