"""Token-budget admission end to end, with real workers: HTTP → Kafka → scheduler →
Celery → engine → Redis. A capacity ceiling makes the budget small, so jobs contend.

Prompts are token ids `[7] * n`, for which the tiny model never emits its end token:
every job generates exactly `max_new_tokens` (about 0.5 ms each), so durations are
predictable enough to reason about order and waiting.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.fleet import Fleet, free_port

TENANTS = json.dumps({"tenants": [
    {"name": "acme", "tier": "silver", "tokens_per_minute": 10**9, "share": 1.0},
    {"name": "cheap", "tier": "bronze", "tokens_per_minute": 10**9, "share": 1.0},
]})


def timing(fleet: Fleet, job_id: str, name: str) -> float:
    return float(fleet.field(job_id, name))


def done(fleet: Fleet, job_ids: list[str]) -> bool:
    return all(fleet.state(j) in ("done", "failed", "rejected", "expired", "cancelled") for j in job_ids)


def test_high_before_normal_before_low(make_fleet):
    # One job at a time fits; the aging bounds are far longer than this test runs, so
    # the order is the classes' alone however fast the machine is.
    env = {"KVFLEET_CAPACITY_CEILING_TOKENS": "1000", "KVFLEET_LOW_MAX_WAIT_S": "600",
           "KVFLEET_NORMAL_MAX_WAIT_S": "600", "KVFLEET_HIGH_MAX_WAIT_S": "600"}
    fleet = make_fleet(workers=1, extra_env=env)
    blocker = fleet.submit("normal", prompt_len=100, max_new_tokens=800)
    fleet.wait_for(lambda: fleet.state(blocker) == "running", "blocker running")
    jobs = {p: [fleet.submit(p, prompt_len=100, max_new_tokens=500) for _ in range(3)]
            for p in ("low", "normal", "high")}
    fleet.wait_for(lambda: done(fleet, sum(jobs.values(), [])), "all done", timeout=120)
    admitted = {p: [timing(fleet, j, "admitted_at") for j in ids] for p, ids in jobs.items()}
    assert max(admitted["high"]) < min(admitted["normal"]) and max(admitted["normal"]) < min(admitted["low"])


def test_a_low_job_overtakes_a_stream_of_high_ones_at_its_aging_bound(make_fleet):
    # A stream of high jobs, kept topped up until the low job is admitted, holds the
    # budget (one job at a time). Without aging the low job would wait forever; with a
    # 4 s bound it goes first once it waited 4 s, ahead of every high job then waiting.
    bound = 4.0
    env = {"KVFLEET_CAPACITY_CEILING_TOKENS": "1000", "KVFLEET_LOW_MAX_WAIT_S": str(bound),
           "KVFLEET_LOW_RESERVE_AFTER_S": "1"}
    fleet = make_fleet(workers=1, extra_env=env)
    highs = [fleet.submit("high", prompt_len=100, max_new_tokens=500)]
    fleet.wait_for(lambda: fleet.state(highs[0]) == "running", "the stream running")
    low = fleet.submit("low", prompt_len=100, max_new_tokens=500)
    deadline = time.monotonic() + 120  # a starved low job: the failure this test exists for
    while fleet.state(low) == "queued":
        assert time.monotonic() < deadline, "the low job starved behind the high stream"
        waiting = [h for h in highs if fleet.state(h) == "queued"]
        if len(waiting) < 3:
            highs.append(fleet.submit("high", prompt_len=100, max_new_tokens=500))
        else:
            time.sleep(0.05)  # a polling interval, not a duration anything depends on
    fleet.wait_for(lambda: done(fleet, [low, *highs]), "stream done", timeout=120)
    low_queued, low_admitted = timing(fleet, low, "queued_at"), timing(fleet, low, "admitted_at")
    assert low_admitted - low_queued >= bound  # it never jumped before its bound ...
    # ... and from its bound on, no high job was admitted before it (the admission
    # times are the policy's own clock, so this holds at any machine speed).
    admitted_high = [timing(fleet, h, "admitted_at") for h in highs]
    assert not [t for t in admitted_high if low_queued + bound <= t < low_admitted]
    overtaken = [h for h in highs if timing(fleet, h, "queued_at") < low_admitted < timing(fleet, h, "admitted_at")]
    assert overtaken  # high jobs were waiting when it went: it overtook them
    assert all(fleet.state(j) == "done" for j in [low, *highs])


def test_a_long_job_amid_a_stream_of_short_ones_runs_within_its_hold(make_fleet):
    # Budget 1000: the long job (900) fits only alone; short ones (300-600 tokens, of
    # staggered lengths) keep refilling what frees up until it is admitted. The exact
    # check that the hold alone prevents starvation is tests/test_scheduler_service.py,
    # which plays the workers; here real workers end jobs at their own pace.
    hold = 1.0
    env = {"KVFLEET_CAPACITY_CEILING_TOKENS": "1000", "KVFLEET_NORMAL_RESERVE_AFTER_S": str(hold)}
    fleet = make_fleet(workers=1, extra_env=env)

    def short(i: int) -> str:
        return fleet.submit(prompt_len=50, max_new_tokens=250 + (i * 53) % 300)

    first = [short(i) for i in range(3)]
    long = fleet.submit(prompt_len=100, max_new_tokens=800)
    stream: list[str] = []
    deadline = time.monotonic() + 120
    while fleet.state(long) == "queued":
        assert time.monotonic() < deadline, "the long job starved behind the short ones"
        if sum(fleet.state(j) == "queued" for j in stream) < 3:
            stream.append(short(3 + len(stream)))
        else:
            time.sleep(0.05)  # a polling interval, not a duration anything depends on
    fleet.wait_for(lambda: done(fleet, [*first, long, *stream]), "all done", timeout=120)
    long_queued, long_admitted = timing(fleet, long, "queued_at"), timing(fleet, long, "admitted_at")
    # From its hold on, no short job that came after it took the budget before it (the
    # ones before it are ahead of it in FIFO order and may still go first).
    assert not [j for j in stream if long_queued + hold <= timing(fleet, j, "admitted_at") < long_admitted]
    assert all(fleet.state(j) == "done" for j in [*first, long, *stream])


def test_budget_spent_pauses_consumption_bounded_then_resumes(make_fleet):
    port = free_port()
    env = {"KVFLEET_CAPACITY_CEILING_TOKENS": "1000", "KVFLEET_MAX_BUFFERED": "4", "KVFLEET_MAX_POLL_RECORDS": "5",
           "KVFLEET_SCHEDULER_METRICS_PORT": str(port)}
    fleet = make_fleet(workers=1, extra_env=env)
    jobs = [fleet.submit("low", prompt_len=100, max_new_tokens=500) for _ in range(30)]
    samples = []

    def sample() -> None:
        while not done(fleet, jobs):
            m = fleet.metrics(port)
            samples.append((m.get('kvfleet_scheduler_paused_partitions{priority="low"}', 0.0),
                            m.get('kvfleet_scheduler_buffered_jobs{priority="low"}', 0.0)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    fleet.wait_for(lambda: done(fleet, jobs), "all done", timeout=90)
    sampler.join()
    assert any(paused == 1 for paused, _ in samples)  # consumption paused while the budget was spent
    assert max(buffered for _, buffered in samples) <= 4 + 5  # max_buffered + one poll, never more
    assert all(fleet.state(j) == "done" for j in jobs)  # ... and resumed: everything ran
    fleet.wait_for(lambda: fleet.metrics(port)['kvfleet_scheduler_paused_partitions{priority="low"}'] == 0,
                   "resumed")


def test_bronze_is_shed_first_when_the_fleet_is_overloaded(make_fleet):
    env = {"KVFLEET_TENANTS": TENANTS, "KVFLEET_CAPACITY_CEILING_TOKENS": "1000",
           "KVFLEET_BRONZE_SHED_AFTER_S": "1.0"}
    fleet = make_fleet(workers=1, extra_env=env)
    # One job at a time, ~0.4 s each: the bronze jobs queue behind ~3 s of silver work.
    silver = [fleet.submit(prompt_len=100, max_new_tokens=800) for _ in range(7)]
    bronze = [fleet.submit(prompt_len=100, max_new_tokens=800, tenant="cheap") for _ in range(3)]
    fleet.wait_for(lambda: done(fleet, [*silver, *bronze]), "all decided", timeout=60)
    results = {j: httpx.get(f"{fleet.url}/v1/jobs/{j}", headers={"X-Tenant-ID": t}).json()
               for j, t in [*((j, "cheap") for j in bronze), *((j, "acme") for j in silver)]}
    assert all(results[j]["status"] == "rejected" and results[j]["error"]["code"] == "overloaded" for j in bronze)
    assert all(results[j]["status"] == "done" for j in silver)  # they waited longer, and were never shed
    waited = [timing(fleet, j, "admitted_at") - timing(fleet, j, "queued_at") for j in silver]
    assert max(waited) > 1.0  # so shedding was by tier, not by waiting time alone


def test_cancel_a_queued_job_and_a_running_one(make_fleet):
    port = free_port()
    env = {"KVFLEET_CAPACITY_CEILING_TOKENS": "2000"}
    fleet = make_fleet(workers=0, model="builtin:bench", extra_env=env)
    fleet.start("worker", env={"KVFLEET_WORKER_METRICS_PORT": str(port)})
    fleet.wait_ready(workers=1)
    acme = {"X-Tenant-ID": "acme"}
    # Greedy on this prompt, the bench model never stops early: 1500 tokens take ~8 s.
    running = fleet.submit(prompt_len=100, max_new_tokens=1500)
    fleet.wait_for(lambda: fleet.state(running) == "running", "running")
    queued = fleet.submit(prompt_len=500, max_new_tokens=500)  # 1000 > the 2000 - 1600 free
    assert fleet.state(queued) == "queued"
    cancelled = httpx.delete(f"{fleet.url}/v1/jobs/{queued}", headers=acme)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"

    assert httpx.delete(f"{fleet.url}/v1/jobs/{running}", headers=acme).json()["status"] == "cancelled"
    # Counted "cancelled", not "done": the engine stopped it mid-run rather than finishing it.
    outcome = 'kvfleet_worker_tasks_total{outcome="cancelled"}'
    fleet.wait_for(lambda: fleet.metrics(port).get(outcome) == 1, "the engine stopped the job", timeout=60)
    ledger_keys = [fleet.keys.ledger, fleet.keys.ledger_leases, fleet.keys.ledger_meta]
    assert not any(fleet.redis.exists(k) for k in ledger_keys)  # every token released

    after = fleet.submit(max_new_tokens=4)  # read after `queued`: the scheduler has seen it
    fleet.wait_for(lambda: fleet.state(after) == "done", "the next job runs")
    assert fleet.state(queued) == "cancelled" and fleet.field(queued, "attempts") == "0"
    assert fleet.field(queued, "started_at") is None and fleet.state(running) == "cancelled"
