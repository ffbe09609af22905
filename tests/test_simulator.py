"""The simulator: deterministic, conserving, and telling the policies apart."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.sim.baselines import FifoPolicy, StrictPriorityPolicy
from bench.sim.simulator import BatchService, Phase, Workload, make_jobs, simulate
from kvfleet.contracts import Priority
from kvfleet.settings import PolicyConfig
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


def test_kvfleet_keeps_high_fast_and_sheds_only_bronze_if_any():
    def p99_wait(result, priority):
        waits = sorted(r.wait for r in result.records if r.job.priority is priority and r.wait is not None)
        return waits[int(0.99 * (len(waits) - 1))]

    kvfleet, fifo = run(Policy()), run(FifoPolicy())
    assert p99_wait(kvfleet, Priority.HIGH) < 0.5 * p99_wait(fifo, Priority.HIGH)
    assert all(r.job.tier is Tier.BRONZE for r in kvfleet.records if r.outcome == "shed")


def _batch_job(i, priority=Priority.NORMAL, prompt=100, new=50, t=0.0):
    from scheduler.policy import PendingJob

    return PendingJob(f"b{i}", "t", Tier.SILVER, priority, prompt_tokens=prompt, max_new_tokens=new, enqueued_at=t)


def _finished(jobs, service, **kwargs) -> dict[str, float]:
    result = simulate(Policy(PolicyConfig(silver_burst=1.0)), jobs, capacity=10**6, service=service,
                      tick_s=0.01, **kwargs)
    return {r.job.job_id: r.finished_at for r in result.records}


def test_a_batch_slows_each_job_by_b_per_companion():
    """Alone, a job takes a + b per token; ten side by side take ten times b each step.
    The step that ends a prompt samples the first token, as the engine's does."""
    service = BatchService(a_s=0.01, b_s_per_token=0.001, workers=1)
    alone = (0.01 + 100 * 0.001) + 49 * (0.01 + 0.001)  # prefill step, then 49 steps of one token
    ten = (0.01 + 10 * 100 * 0.001) + 49 * (0.01 + 10 * 0.001)
    assert max(_finished([_batch_job(0)], service).values()) == pytest.approx(alone, abs=1e-9)
    assert max(_finished([_batch_job(i) for i in range(10)], service).values()) == pytest.approx(ten, abs=1e-9)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget():
    service = BatchService(a_s=0.01, b_s_per_token=0.001, workers=1, max_num_batched_tokens=256)
    # 600 prompt tokens: chunks of 256, 256 and 88 (the last samples the first token), then 9 decodes.
    expected = 2 * (0.01 + 0.256) + (0.01 + 0.088) + 9 * 0.011
    assert _finished([_batch_job(0, prompt=600, new=10)], service)["b0"] == pytest.approx(expected, abs=1e-9)


def test_prompts_beside_decodes_take_only_the_decode_step_slack():
    """The engine's stall-free decodes: while a job decodes, a prompt beside it takes the
    tokens that keep the step within `decode_step_slack` of the decode alone."""
    b = 1 / 1024  # a binary fraction: every step time below adds up exactly
    # a = 9b: one decode alone takes 10b, slack 1.0 lets 10 prompt tokens beside it.
    service = BatchService(a_s=9 * b, b_s_per_token=b, workers=1, decode_step_slack=1.0)
    decoder = _batch_job(0, prompt=1, new=30)
    prompt = _batch_job(1, prompt=600, new=1, t=0.001)  # admitted at the tick after the decoder's 2nd step
    done = _finished([decoder, prompt], service)
    # Two steps of 10b; then 28 of 20b (its decode, 10 of the prompt); then the prompt's
    # last 320 tokens alone, a step of 9b + 320b.
    assert done["b0"] == pytest.approx(20 * b + 28 * 20 * b, abs=1e-12)
    assert done["b1"] == pytest.approx(done["b0"] + 329 * b, abs=1e-12)
    # Without it the whole prompt goes into one step, 610b, that the decode waits for.
    free = _finished([decoder, prompt], dataclasses.replace(service, decode_step_slack=math.inf))
    assert free["b1"] == pytest.approx(20 * b + 610 * b, abs=1e-12)
    assert free["b0"] == pytest.approx(free["b1"] + 27 * 10 * b, abs=1e-12)


def test_a_prompt_ahead_of_every_decode_is_not_held_to_the_slack():
    """As the engine: the stall-free bound spares the decodes ahead of a prompt in service
    order, so a high prompt beside a low job's decodes goes into one step."""
    b = 1 / 1024
    service = BatchService(a_s=9 * b, b_s_per_token=b, workers=1, decode_step_slack=1.0)
    decoder = _batch_job(0, Priority.LOW, prompt=1, new=30)
    prompt = _batch_job(1, Priority.HIGH, prompt=600, new=1, t=0.001)
    done = _finished([decoder, prompt], service)
    # Two steps of 10b, then the whole prompt beside the decode (9b + 601b).
    assert done["b1"] == pytest.approx(20 * b + 610 * b, abs=1e-12)


def test_the_priority_guard_holds_lower_classes_back_while_high_runs():
    """The engine's guard (workers/engine/scheduler.py): while a high job is in the
    engine, lower classes get only the tokens that keep its steps within the slack."""
    # a = b: a high decode step alone costs 2b, so slack 1.0 lets 2 lower tokens ride along.
    service = BatchService(a_s=0.001, b_s_per_token=0.001, workers=1, priority_step_slack=1.0)
    high = _batch_job(0, Priority.HIGH, prompt=1, new=100)
    lows = [_batch_job(i, Priority.LOW, prompt=1, new=100) for i in (1, 2, 3, 4)]
    done = _finished([high, *lows], service)
    # High's steps: its token and the two oldest lows' (4 ms), for 100 steps.
    assert done["b0"] == pytest.approx(100 * 0.004, abs=1e-9)
    assert done["b1"] == done["b2"] == done["b0"]  # the two oldest rode along at full speed
    assert done["b3"] > done["b0"] + 99 * 0.003  # the others waited for high to leave
    # Without the guard all five share every step.
    free = _finished([high, *lows], BatchService(a_s=0.001, b_s_per_token=0.001, workers=1,
                                                 priority_step_slack=math.inf))
    assert free["b0"] == pytest.approx(100 * 0.006, abs=1e-9) and free["b4"] == free["b0"]


def test_queued_tasks_go_to_any_free_thread_high_first():
    """Past its threads a worker takes nothing more; the Celery queue is read high first."""
    service = BatchService(a_s=0.01, b_s_per_token=0.0, workers=2, max_seqs=1)
    jobs = [_batch_job(0, new=10), _batch_job(1, new=20), _batch_job(2, Priority.LOW, new=10, t=0.001),
            _batch_job(3, Priority.HIGH, new=10, t=0.002)]
    result = simulate(FifoPolicy(), jobs, capacity=10**6, service=service, tick_s=0.01)
    done = {r.job.job_id: r.finished_at for r in result.records}
    # Both threads taken by b0 and b1; b0's frees at 0.1 s and high (b3), queued after
    # low (b2), takes it first.
    assert done["b3"] < done["b2"]
    assert done["b3"] == pytest.approx(0.1 + 0.1, abs=0.011)  # starts at the tick after the thread frees


def test_goodput_counts_only_jobs_in_time():
    w = Workload(seed=3, capacity_tokens=32_768, phases=(Phase(0, 20, 3.0),), timeout_s=10.0,
                 service=BatchService(workers=1))
    result = run(Policy(), w)
    done = [r for r in result.records if r.outcome == "done"]
    assert any(not r.in_time for r in done) and any(r.in_time for r in done)
    assert all(r.in_time == (r.finished_at <= r.job.deadline) for r in done)
