"""The runs of a several-job message begun together (workers/runner.py `begin_all`): one
round trip for every job's `begin`, and each job then decided exactly as a one-job
message's would be. A stub engine; the real Redis."""

from __future__ import annotations

import threading
import time

import pytest

from kvfleet.constants import Keys
from kvfleet.contracts import Completion, JobRequest, JobResult, JobState, Priority, Timings, to_builtins
from kvfleet.jobstore import JobStore
from kvstore.lock import Lease
from workers.drain import HandBack
from workers.runner import JobRunner


class _Engine:
    """Generates one token at once; counts what it ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def generate(self, request_id, prompt_tokens, max_new_tokens, sampling, **_):
        self.ran.append(request_id)
        now = time.time()
        return Completion(text="x", tokens=[1], finish_reason="length", prompt_tokens=len(prompt_tokens),
                          cached_tokens=0, started_at=now, first_token_at=now, finished_at=now, submitted_at=now)

    def cancel(self, request_id: str) -> bool:
        return False


def _request(job_id: str) -> JobRequest:
    return JobRequest(job_id=job_id, tenant="acme", priority=Priority.NORMAL, model="builtin:tiny",
                      max_new_tokens=1, submitted_at=time.time(), prompt_tokens=[1, 2, 3])


@pytest.fixture
def setup(redis_client, prefix):
    store = JobStore(redis_client, Keys(prefix))
    engine = _Engine()
    draining = threading.Event()
    runner = JobRunner(store, redis_client, engine, tokenizer=None, worker_id="w", lease_s=5.0, poll_s=0.05,
                       draining=draining)
    return store, engine, runner, draining


def test_a_message_begins_in_one_call_and_each_job_is_decided_as_alone(setup, redis_client):
    store, engine, runner, _ = setup
    fresh, done, held = _request("fresh"), _request("done"), _request("held")
    for job in (fresh, done, held):
        store.create(job)
    store.start("done", now=time.time(), worker="earlier")
    assert store.finish(JobResult(job_id="done", status=JobState.DONE, tenant="acme", priority=Priority.NORMAL,
                                  timings=Timings(finished_at=time.time()))).ok
    other = Lease(redis_client, store.keys.run_lease("held"), 5000)
    assert other.acquire()  # a live copy runs it elsewhere
    raws = [to_builtins(fresh), to_builtins(done), to_builtins(held), {"job_id": "fresh", "v": "bad"}]

    claims = runner.begin_all(raws)
    assert [c.begun.outcome if c else None for c in claims] == ["started", "terminal", None, None]
    assert store.state("fresh") is JobState.RUNNING
    assert runner.running_jobs() == ["fresh"]  # watched (its leases renewed) before its thread runs it

    assert runner.run(raws[0], claim=claims[0]).label == "done"
    assert runner.run(raws[1], claim=claims[1]).label == "duplicate"
    assert engine.ran == ["fresh"]
    assert store.get("fresh").attempt == 1  # begun once, not again by its run
    assert redis_client.get(store.keys.run_lease("fresh")) is None  # the finish released it
    assert redis_client.get(store.keys.run_lease("held")).decode() == other.token
    assert runner.running_jobs() == []


def test_a_drain_before_the_thread_runs_gives_the_begun_run_up(setup, redis_client):
    store, engine, runner, draining = setup
    job = _request("late")
    store.create(job)
    [claim] = runner.begin_all([to_builtins(job)])
    draining.set()
    with pytest.raises(HandBack):
        runner.run(to_builtins(job), claim=claim)
    assert engine.ran == []
    assert redis_client.get(store.keys.run_lease("late")) is None  # free for the run that comes back
    assert runner.running_jobs() == []
    assert runner.begin_all([to_builtins(job)]) == [None]  # nothing begins while draining
