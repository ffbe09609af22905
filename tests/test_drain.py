"""A worker's graceful drain on SIGTERM (workers/drain.py), through the real fleet.

Both tests set the Celery visibility timeout to ten minutes and wait for their jobs far
less: a job that needed the broker to notice a lost task would fail them. Names: api-1,
scheduler-2, worker-3 (the one drained), worker-4 (started after).
"""

from __future__ import annotations

import signal
import time

from kvfleet import registry
from producer.client import Client

NO_REDELIVERY = {"KVFLEET_VISIBILITY_TIMEOUT_S": "600"}


def _worker_pid(fleet, job_id: str) -> int:
    """The pid in the id of the worker that last started the job (host-pid-suffix)."""
    return int(fleet.field(job_id, "worker").rsplit("-", 2)[-2])


def _running(fleet, job_ids: list[str], at_least: int) -> list[str]:
    return fleet.wait_for(lambda: [j for j in job_ids if fleet.state(j) == "running"][:at_least]
                          if sum(fleet.state(j) == "running" for j in job_ids) >= at_least else None,
                          f"{at_least} jobs running", timeout=120)


def test_sigterm_finishes_running_jobs_and_hands_back_the_unstarted(make_fleet):
    # Two task threads: two jobs run, the others wait in the queue or in the worker's
    # prefetch, which the drain must give back at once.
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env={
        **NO_REDELIVERY, "KVFLEET_WORKER_CONCURRENCY": "2", "KVFLEET_WORKER_DRAIN_GRACE_S": "120"})
    with Client(fleet.url, tenant="acme") as client:
        jobs = [client.submit(f"drain me {i}", max_new_tokens=120, temperature=0.0) for i in range(6)]
        running = _running(fleet, jobs, 2)
        worker = fleet.procs["worker-3"]
        worker.send_signal(signal.SIGTERM)
        fleet.killed.add("worker-3")  # it is meant to exit
        # Capacity is withdrawn at once, while its jobs still run.
        fleet.wait_for(lambda: registry.live(fleet.redis, fleet.keys) == [], "the heartbeat to go", timeout=10)
        assert worker.poll() is None and all(fleet.state(j) == "running" for j in running)
        worker.wait(timeout=120)
        assert worker.returncode == 0
        for job_id in running:  # finished where they ran, within the grace period
            assert fleet.state(job_id) == "done" and fleet.field(job_id, "attempts") == "1"
            assert _worker_pid(fleet, job_id) == worker.pid
        fleet.start("worker")
        results = [client.wait(j, timeout=180) for j in jobs]
    assert [r.status.value for r in results] == ["done"] * 6
    assert all(fleet.field(j, "attempts") == "1" for j in jobs)  # nothing ran twice
    moved = [j for j in jobs if j not in running]
    assert all(_worker_pid(fleet, j) == fleet.procs["worker-4"].pid for j in moved)


def test_a_job_past_the_grace_period_goes_to_another_worker_at_once(make_fleet):
    fleet = make_fleet(workers=1, model="builtin:bench", extra_env={
        **NO_REDELIVERY, "KVFLEET_WORKER_DRAIN_GRACE_S": "1"})
    with Client(fleet.url, tenant="acme") as client:
        # Greedy on the bench model's random weights, this prompt runs ~1,000 tokens
        # (several seconds here) before its EOS: far past a second of grace.
        job_id = client.submit("a long job 3", max_new_tokens=3000, temperature=0.0)
        _running(fleet, [job_id], 1)
        worker = fleet.procs["worker-3"]
        worker.send_signal(signal.SIGTERM)
        fleet.killed.add("worker-3")
        worker.wait(timeout=60)  # a second of grace, then the job is handed back
        assert worker.returncode == 0
        assert fleet.state(job_id) == "running" and fleet.field(job_id, "attempts") == "1"
        handed_back = time.monotonic()
        fleet.start("worker")
        fleet.wait_for(lambda: fleet.field(job_id, "attempts") == "2", "the job to start again", timeout=120)
        # Started again as soon as a worker was there, not after the ten-minute timeout.
        assert time.monotonic() - handed_back < 120
        result = client.wait(job_id, timeout=300)
    assert result.status.value == "done" and len(result.tokens) > 100
    assert _worker_pid(fleet, job_id) == fleet.procs["worker-4"].pid
