"""Messages of several jobs (workers/tasks.py `run_jobs`) through a real worker, Celery
on the real Redis: each job runs once and side by side with the others, a worker killed
mid-message loses none and reruns only what it had not finished, and a drain hands back
only what it had not finished.

The tests send the message themselves, through the scheduler's own `Dispatcher`, so that
it is exactly one message of the jobs they name (the scheduler packs only large rounds).
Names: api-1, scheduler-2, worker-3, worker-4 (started after).
"""

from __future__ import annotations

import json
import signal
import time

import msgspec

from kvfleet.celery_app import make_celery
from kvfleet.constants import celery_queue
from kvfleet.contracts import JobRequest, Priority, Sampling
from kvfleet.jobstore import Admit, JobStore
from kvfleet.settings import Settings
from scheduler.dispatch import Dispatcher
from tests.fleet import Fleet

NO_REDELIVERY = {"KVFLEET_VISIBILITY_TIMEOUT_S": "600"}
# Greedy on the bench model's random weights this prompt runs ~1,000 tokens before its
# EOS (several seconds here), as in tests/test_drain.py; "quick" ones stop at one token.
LONG = ("a long job 3", 3000)
QUICK = ("quick", 1)


def send_one_message(fleet: Fleet, jobs: list[tuple[str, int]], priority: Priority = Priority.NORMAL) -> list[str]:
    """The jobs (prompt, max new tokens) recorded, admitted and sent as one Celery
    message, as the scheduler does it; their ids, in the message's order."""
    store = JobStore(fleet.redis, fleet.keys)
    requests = [JobRequest(job_id=f"m{i}-{time.monotonic_ns()}", tenant="acme", priority=priority,
                           model="builtin:bench", prompt=prompt, max_new_tokens=n, submitted_at=time.time(),
                           sampling=Sampling(temperature=0.0))
                for i, (prompt, n) in enumerate(jobs)]
    for request in requests:
        store.create(request)
    admitted = store.admit_many([Admit(r.job_id, 64, r.tenant, r.priority) for r in requests], capacity=10**9,
                                lease_s=600, now=time.time(), by="test")
    assert all(a.reserved for a in admitted)
    dispatcher = Dispatcher(store, make_celery(Settings.from_env(fleet.env)), fleet.prefix, lease_s=600,
                            replica="test")
    dispatcher.send([requests])
    return [r.job_id for r in requests]


def result(fleet: Fleet, job_id: str) -> dict:
    return msgspec.json.decode(fleet.field(job_id, "result"))


def all_done(fleet: Fleet, job_ids: list[str], timeout: float = 180) -> None:
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in job_ids), "every job done", timeout=timeout)


def worker_pid(fleet: Fleet, job_id: str) -> int:
    """The pid in the id of the worker that last started the job (host-pid-suffix)."""
    return int(fleet.field(job_id, "worker").rsplit("-", 2)[-2])


def test_a_message_of_several_jobs_runs_each_once_side_by_side(make_fleet):
    # One task thread: the four jobs of the one message can only overlap if the message
    # runs them side by side.
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env={**NO_REDELIVERY, "KVFLEET_WORKER_CONCURRENCY": "1"})
    jobs = send_one_message(fleet, [(f"side by side {i}", 120) for i in range(4)])
    all_done(fleet, jobs)
    assert all(fleet.field(j, "attempts") == "1" for j in jobs)
    timings = [result(fleet, j)["timings"] for j in jobs]
    assert max(t["started_at"] for t in timings) < min(t["finished_at"] for t in timings)  # all ran at once
    # Acknowledged once all ended: nothing of this fleet's left queued or unacknowledged.
    queue = celery_queue(fleet.prefix, Priority.NORMAL)

    def acknowledged() -> bool:  # kombu's unacked hash: delivery tag -> [message, exchange, routing key]
        unacked = [json.loads(v)[2] for v in fleet.redis.hvals("unacked")]
        return queue not in unacked and fleet.redis.llen(queue) == 0

    fleet.wait_for(acknowledged, "the message acknowledged")


def test_a_worker_takes_only_its_share_of_jobs_and_high_ones_still_get_in(make_fleet):
    # Four slots, one of them high's (workers/gate.py): three normal jobs fill the shared
    # ones, so a fourth stays in the broker's queue (for any worker with room), while a
    # high job sent after it is read and runs. Celery alone, counting messages, would
    # take the fourth job as well: it has threads free.
    fleet = make_fleet(workers=1, model="builtin:bench",
                       extra_env={**NO_REDELIVERY, "KVFLEET_WORKER_CONCURRENCY": "4", "KVFLEET_HIGH_SLOT_RESERVE": "0.25"})
    first = send_one_message(fleet, [LONG] * 3)
    fleet.wait_for(lambda: all(fleet.state(j) == "running" for j in first), "the three long jobs running")
    waiting = send_one_message(fleet, [LONG])
    high = send_one_message(fleet, [QUICK], priority=Priority.HIGH)
    fleet.wait_for(lambda: fleet.state(high[0]) == "done", "the high job done while the shared slots are full")
    assert fleet.redis.llen(celery_queue(fleet.prefix, Priority.NORMAL)) == 1
    assert all(fleet.state(j) == "running" for j in first) and fleet.state(waiting[0]) == "admitted"
    all_done(fleet, first + waiting)  # read once a slot frees
    assert all(fleet.field(j, "attempts") == "1" for j in first + waiting)


def test_a_worker_killed_mid_message_loses_nothing_and_reruns_only_the_unfinished(make_fleet):
    # A short visibility timeout: the dead worker's unacknowledged message comes back in seconds.
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env={"KVFLEET_VISIBILITY_TIMEOUT_S": "6"})
    jobs = send_one_message(fleet, [QUICK, LONG, QUICK, LONG, QUICK])
    quick, long = jobs[::2], jobs[1::2]
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in quick)
                   and all(fleet.state(j) == "running" for j in long), "the quick jobs done, the long ones running")
    finished = {j: fleet.field(j, "result") for j in quick}
    fleet.kill("worker-3")
    fleet.start("worker")
    all_done(fleet, jobs)
    for job_id in quick:  # finished before the kill: the redelivered message left them alone
        assert fleet.field(job_id, "attempts") == "1" and fleet.field(job_id, "result") == finished[job_id]
    for job_id in long:  # cut off by the kill: run again, to the end, once
        assert fleet.field(job_id, "attempts") == "2"
        assert worker_pid(fleet, job_id) == fleet.procs["worker-4"].pid
        assert result(fleet, job_id)["usage"]["completion_tokens"] > 100


def test_a_drain_hands_back_the_unfinished_jobs_of_a_message_at_once(make_fleet):
    fleet = make_fleet(workers=1, model="builtin:bench",
                       extra_env={**NO_REDELIVERY, "KVFLEET_WORKER_DRAIN_GRACE_S": "1"})
    jobs = send_one_message(fleet, [QUICK, LONG, QUICK])
    quick, long = [jobs[0], jobs[2]], jobs[1]
    fleet.wait_for(lambda: all(fleet.state(j) == "done" for j in quick) and fleet.state(long) == "running",
                   "the quick jobs done, the long one running")
    finished = {j: fleet.field(j, "result") for j in quick}
    worker = fleet.procs["worker-3"]
    worker.send_signal(signal.SIGTERM)
    fleet.killed.add("worker-3")  # it is meant to exit
    worker.wait(timeout=60)  # a second of grace, then the long job is handed back
    assert worker.returncode == 0
    assert fleet.state(long) == "running" and fleet.field(long, "attempts") == "1"
    fleet.start("worker")
    # Requeued at once (the visibility timeout is ten minutes): the new worker reruns the
    # long job and finds the quick ones finished.
    all_done(fleet, jobs, timeout=300)
    assert fleet.field(long, "attempts") == "2" and worker_pid(fleet, long) == fleet.procs["worker-4"].pid
    for job_id in quick:
        assert fleet.field(job_id, "attempts") == "1" and fleet.field(job_id, "result") == finished[job_id]
        assert worker_pid(fleet, job_id) == worker.pid
