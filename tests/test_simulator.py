"""The simulator: deterministic, conserving, and telling the policies apart."""

from __future__ import annotations

from bench.sim.baselines import FifoPolicy, StrictPriorityPolicy
from bench.sim.simulator import Phase, Workload, make_jobs, simulate
from kvfleet.contracts import Priority
from kvfleet.tenancy import Tier
from scheduler.policy import Policy

# A short burst on a small fleet keeps each run well under a second.
SMALL = Workload(seed=7, capacity_tokens=32_768, phases=(Phase(0, 10, 0.5), Phase(10, 15, 5.0), Phase(15, 30, 0.5)))


def run(policy, workload=SMALL):
    return simulate(policy, make_jobs(workload), capacity=workload.capacity_tokens, service=workload.service)


def fingerprint(result) -> list[tuple]:
    return [(r.job.job_id, r.outcome, r.admitted_at, r.finished_at) for r in result.records]


def test_same_workload_same_result():
    assert make_jobs(SMALL) == make_jobs(SMALL)
    first, second = run(Policy()), run(Policy())
    assert fingerprint(first) == fingerprint(second) and first.timeline == second.timeline
    other = Workload(seed=8, capacity_tokens=SMALL.capacity_tokens, phases=SMALL.phases)
    assert make_jobs(other) != make_jobs(SMALL)


def test_every_job_is_decided_and_the_budget_is_never_exceeded():
    for policy in (Policy(), FifoPolicy(), StrictPriorityPolicy()):
        result = run(policy)
        assert {r.outcome for r in result.records} <= {"done", "rejected", "shed", "expired"}
        assert all(in_use <= SMALL.capacity_tokens for _, _, in_use in result.timeline)
        assert any(in_use > 0.9 * SMALL.capacity_tokens for _, _, in_use in result.timeline)  # it was busy
        for r in result.records:
            if r.outcome == "done":
                assert r.admitted_at >= r.job.enqueued_at


def test_the_burst_arrives_at_five_times_the_base_rate():
    jobs = make_jobs(Workload(seed=1))
    base = sum(1 for j in jobs if j.enqueued_at < 30) / 30
    burst = sum(1 for j in jobs if 30 <= j.enqueued_at < 40) / 10
    assert 8.0 < burst / base < 12.0  # load 5.0 over 0.5


def test_kvfleet_keeps_high_fast_and_sheds_only_bronze():
    def p99_wait(result, priority):
        waits = sorted(r.wait for r in result.records if r.job.priority is priority and r.wait is not None)
        return waits[int(0.99 * (len(waits) - 1))]

    kvfleet, fifo = run(Policy()), run(FifoPolicy())
    assert p99_wait(kvfleet, Priority.HIGH) < 0.5 * p99_wait(fifo, Priority.HIGH)
    shed = [r for r in kvfleet.records if r.outcome == "shed"]
    assert shed and all(r.job.tier is Tier.BRONZE for r in shed)


def test_a_batch_slows_each_job_by_b_per_companion():
    """Alone, a job takes a + b per token; ten side by side take ten times b each step."""
    from bench.sim.simulator import BatchService
    from scheduler.policy import PendingJob

    service = BatchService(a_s=0.01, b_s_per_token=0.001, workers=1)

    def job(i):
        return PendingJob(f"b{i}", "t", Tier.SILVER, Priority.NORMAL, prompt_tokens=100, max_new_tokens=50,
                          enqueued_at=0.0)

    def e2e(n):
        result = simulate(Policy(), [job(i) for i in range(n)], capacity=10**6, service=service, tick_s=0.01)
        return max(r.finished_at for r in result.records)

    alone = 100 * 0.001 + 50 * (0.01 + 0.001)  # prefill stall, then 50 steps of one token
    ten = 10 * 100 * 0.001 + 50 * (0.01 + 10 * 0.001)
    assert abs(e2e(1) - alone) < 1e-9
    assert abs(e2e(10) - ten) < 1e-9


def test_goodput_counts_only_jobs_in_time():
    from bench.sim.simulator import BatchService

    w = Workload(seed=3, capacity_tokens=32_768, phases=(Phase(0, 20, 3.0),), timeout_s=10.0,
                 service=BatchService(workers=1))
    result = run(Policy(), w)
    done = [r for r in result.records if r.outcome == "done"]
    assert any(not r.in_time for r in done) and any(r.in_time for r in done)
    assert all(r.in_time == (r.finished_at <= r.job.deadline) for r in done)
