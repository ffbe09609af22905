"""Scheduler benchmark: kvfleet's admission policy against FIFO and strict priority,
replayed through the simulator (bench/sim/simulator.py) with a virtual clock.

    python bench/scheduler.py [--quick] [--seeds N] [--first-seed K] [--out bench/results]

Fleet: 4 workers × 32k KV tokens, 16 task threads each, each running its engine's
continuous batch step by step, a step taking a + b·n_tokens (bench/sim/simulator.py
`BatchService`: a job's time grows with the batch it shares; chunked prefill, the
stall-free decodes' bound on prompts beside decodes and the engine's priority guard as
in workers/engine/scheduler.py; a and b of builtin:bench on
one CPU thread). Workload: 10% high / 50% normal /
40% low jobs, prompts from 32 tokens to near the 8k context limit. Tenants and their
quotas (fractions of the fleet): gold-co 0.3 (gold, reserve 0.3), silver-a 0.3,
silver-b 0.3, and bronze-x 0.1 (bronze, hard limit 0.1), which sends 10× its quota's
share of the jobs (53% of them). Deadlines after arrival: high 30 s, normal 120 s,
low 300 s. Two scenarios, each replayed for every policy with the same jobs: "unloaded"
(30% load for 120 s) and "burst" (100% load, then 10 s at 5×, then 100% until 120 s;
load = offered jobs ÷ what the full fleet serves). Percentiles pool the seeds.

One row per policy (FIFO, strict priority, kvfleet, and `kvfleet_no_shed`: kvfleet with
bronze never shed, to show what shedding costs), all under the burst:
- high p99 × unloaded: the high class's p99 end-to-end over the same policy's unloaded
  p99; a high job that never ran (expired, shed) counts as infinitely late;
- low p99 wait: the low class's p99 wait with every shed or expired job a failure
  (infinite wait; "failed" / null when the p99 lands on one), over all tenants and over
  the compliant ones (all but bronze-x); jobs over a ceiling (the API's 422) are left out;
- Jain vs quota: `jain_vs_quota()` (each tenant's goodput over its weighted max-min fair
  share, capped at 1);
- goodput: tokens (prompt + max_new) of the jobs finished before their deadline, per
  second of arrivals.
kvfleet's targets: the best goodput, Jain ≥ 0.95, high p99 ≤ 1.2 × unloaded, and the low
class's p99 wait within its aging bound (`PolicyConfig.low.max_wait_s`); the same checks
are applied to every row (`misses`).

`high_alone_p99_over_unloaded`: the burst's high jobs replayed alone (no normal or low
job at all, so no slot, token or engine step is shared with them), each admitted as it
arrives, over kvfleet's unloaded p99: what the high class's own burst costs it. A policy
that serves the other classes too can hardly do better.

`live_dispatch()` is the one part that is not simulated: jobs go through the real
Kafka, the scheduler loop of `scheduler/service.py` (policy, ledger reservation in the
job store's admission script, batched Celery sends), the Redis job store and the Celery
broker to real workers (`--live-workers`, default 2, builtin:tiny, started with the
integration tests' launcher tests/fleet.py), whose heartbeats are the budget and whose
finished jobs release their reservations; jobs are 4 new tokens, so it measures dispatch
more than inference. Paced at 50 jobs/s: `dispatch_p50_ms` / `dispatch_p99_ms`
(submission → `admitted_at`, the scheduler step's clock read before the admission Lua
and the send) and `dispatch_to_start_p50_ms` / `_p99_ms` (submission → `started_at`, which
the worker writes on taking the task, after the admission is durable and the task sent).
A burst: `dispatch_burst_jobs_per_s`, the jobs admitted after the first admission batch
over first → last admission, bounded by how fast the workers free slots. The output
names the workers, their KV tokens and slots. `--sim-only` skips it and keeps the live
figures of the scheduler.json it rewrites (`live_command` names the run that measured
them); `--live-only` runs only it and writes nothing.

Prints tables, writes <out>/scheduler.json and <out>/scheduler.png.
"""

from __future__ import annotations

import argparse
from collections import Counter
import dataclasses
import json
import logging
import math
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, whose files would shadow the packages they are named after.
if not __package__:
    sys.path[0] = str(ROOT)

import redis  # noqa: E402
from kafka.admin import KafkaAdminClient  # noqa: E402

import kvfleet.infra  # noqa: E402
from kvfleet import constants, registry  # noqa: E402
from kvfleet.constants import request_topic  # noqa: E402
from kvfleet.contracts import JobRequest, JobState, Priority, WorkerHeartbeat, decode_request, encode  # noqa: E402
from kvfleet.jobstore import JobStore  # noqa: E402
from kvfleet.kafka import make_producer  # noqa: E402
from kvfleet.settings import KafkaSettings, Settings  # noqa: E402
from kvfleet.settings import PolicyConfig  # noqa: E402
from kvfleet.tenancy import Tenant, Tier  # noqa: E402
from kvfleet.tokenizer import ByteTokenizer  # noqa: E402
from scheduler.policy import Policy  # noqa: E402
from bench.sim.baselines import FifoPolicy, StrictPriorityPolicy  # noqa: E402
from bench.sim.simulator import (BatchService, JobRecord, Phase, SimResult, SimTenant, Workload,  # noqa: E402
                                 make_jobs, simulate)
from tests.fleet import Fleet  # noqa: E402  (the integration tests' process launcher)

class NoShedPolicy(Policy):
    """kvfleet's policy with bronze never shed (`bronze_shed_late` off, no
    `bronze_shed_after_s`): the row that shows what shedding the abusive tenant's excess
    costs on the bench's keys."""

    name = "kvfleet_no_shed"

    def __init__(self, config: PolicyConfig, tenants) -> None:
        super().__init__(config.replace(bronze_shed_late=False, bronze_shed_after_s=None), tenants)


POLICIES = (Policy, FifoPolicy, StrictPriorityPolicy, NoShedPolicy)
BASELINES = ("fifo", "strict")
HELLO = ByteTokenizer().encode("hello")  # builtin:tiny's tokens for "hello", as the API sends them
CONFIG = PolicyConfig()
SERVICE = BatchService(max_seqs=16)  # 16 threads a worker: its Celery concurrency
ABUSE = 10.0  # the abusive tenant sends this many times its quota's share of the jobs
SIM_TENANTS = (
    SimTenant("gold-co", Tier.GOLD, traffic=0.3, quota=0.3),
    SimTenant("silver-a", Tier.SILVER, traffic=0.3, quota=0.3),
    SimTenant("silver-b", Tier.SILVER, traffic=0.3, quota=0.3),
    SimTenant("bronze-x", Tier.BRONZE, traffic=0.1 * ABUSE, quota=0.1),
)
ABUSER = "bronze-x"
#: The policy's view of them: gold's reserve and bronze's hard limit are their quotas.
TENANTS = {"gold-co": Tenant(name="gold-co", tier=Tier.GOLD, tokens_per_minute=10**9, share=0.3),
           "bronze-x": Tenant(name="bronze-x", tier=Tier.BRONZE, tokens_per_minute=10**9, share=0.1)}
#: Deadlines after arrival: an interactive high job is useless after 30 s.
TIMEOUTS = ((Priority.HIGH, 30.0), (Priority.NORMAL, 120.0), (Priority.LOW, 300.0))
ARRIVALS_S = 120.0
BURST = (30.0, 40.0)
SCENARIOS = {
    "unloaded": (Phase(0, ARRIVALS_S, 0.3),),
    "burst": (Phase(0, BURST[0], 1.0), Phase(*BURST, 5.0), Phase(BURST[1], ARRIVALS_S, 1.0)),
}
HIGH_P99_TARGET = 1.2
JAIN_TARGET = 0.95
LOW_AGING_BOUND_S = CONFIG.low.max_wait_s
FAILED = ("expired", "shed", "waiting")  # never served; "rejected" (over a ceiling: the API's 422) is left out
LIVE_DB = 3  # tests use Redis database 1, the kvstore bench 2, the demo 0
LIVE_WORKERS = 2  # one per core of the development VM
LIVE_MAX_NEW_TOKENS = 4  # a few output tokens: the live run measures dispatch, not inference
STALL_S = 20.0  # no job finished for this long, none reserved or buffered: the jobs left are lost


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


def finite(v: float | None) -> float | None:
    """JSON has no infinity: a percentile that lands on a failure is written as null."""
    return None if v is None or math.isinf(v) else v


def workload(seed: int, scenario: str, service: BatchService = SERVICE) -> Workload:
    return Workload(seed=seed, phases=SCENARIOS[scenario], tenants=SIM_TENANTS, timeouts=TIMEOUTS,
                    service=service, oversize=0.0)


def run(scenario: str, seeds: range, service: BatchService = SERVICE) -> dict[str, list[SimResult]]:
    results: dict[str, list[SimResult]] = {p.name: [] for p in POLICIES}
    for seed in seeds:
        w = workload(seed, scenario, service)
        jobs = make_jobs(w)
        for policy in POLICIES:
            results[policy.name].append(simulate(policy(CONFIG, TENANTS), jobs, capacity=w.capacity_tokens,
                                                 service=w.service))
    return results


def high_alone(seeds: range, service: BatchService = SERVICE) -> float | None:
    """High p99 end to end under the burst with only the high jobs (see the docstring)."""
    e2e = []
    for seed in seeds:
        w = workload(seed, "burst", service)
        jobs = [j for j in make_jobs(w) if j.priority is Priority.HIGH]
        result = simulate(StrictPriorityPolicy(CONFIG, TENANTS), jobs, capacity=w.capacity_tokens, service=w.service)
        e2e += [e2e_or_inf(r) for r in result.records]
    return pct(e2e, 0.99)


def e2e_or_inf(r: JobRecord) -> float:
    """End-to-end seconds; a job that never ran counts as infinitely late."""
    return math.inf if r.outcome in FAILED else r.e2e


def wait_or_inf(r: JobRecord) -> float:
    return math.inf if r.outcome in FAILED else r.wait


def jain_vs_quota(records: list[JobRecord]) -> tuple[float, dict[str, float]]:
    """Jain's index over tenants of x = goodput ÷ fair share, each x capped at 1.

    Goodput: the tokens (prompt + max_new) of a tenant's jobs finished before their
    deadline. Fair share: the weighted max-min split of everyone's goodput together,
    quotas as the weights and each tenant's submitted tokens as its cap (water-filling:
    a tenant that asked for less than its quota's part gets what it asked, the rest is
    split among the others by quota). Capped at 1, so a tenant served beyond its share
    (the abusive one, or anyone when others asked for less) raises nothing: the index
    falls only for tenants served below their share."""
    quota = {t.name: t.quota for t in SIM_TENANTS}
    demand = {t: 0 for t in quota}
    good = {t: 0 for t in quota}
    for r in records:
        if r.outcome != "rejected":
            demand[r.job.tenant] += r.job.cost
        if r.in_time:
            good[r.job.tenant] += r.job.cost
    left, active, fair = float(sum(good.values())), set(quota), {}
    while active:
        level = left / sum(quota[t] for t in active)
        capped = {t for t in active if demand[t] <= level * quota[t]}
        if not capped:
            fair.update({t: level * quota[t] for t in active})
            break
        for t in capped:
            fair[t] = demand[t]
            left -= demand[t]
        active -= capped
    x = {t: min(1.0, good[t] / fair[t]) if fair[t] > 0 else 1.0 for t in quota}
    return sum(x.values()) ** 2 / (len(x) * sum(v * v for v in x.values())), x


def summarize(burst: list[SimResult], unloaded: list[SimResult]) -> dict:
    records = [r for res in burst for r in res.records]
    of = lambda p, rs=records: [r for r in rs if r.job.priority is p]  # noqa: E731
    high_unloaded = pct([e2e_or_inf(r) for res in unloaded for r in of(Priority.HIGH, res.records)], 0.99)
    high_burst = pct([e2e_or_inf(r) for r in of(Priority.HIGH) if r.outcome != "rejected"], 0.99)
    low = [r for r in of(Priority.LOW) if r.outcome != "rejected"]
    jain, x = jain_vs_quota(records)
    classes = {}
    for p in Priority:
        cls = of(p)
        classes[p.value] = {
            "jobs": len(cls), **{o: sum(r.outcome == o for r in cls) for o in ("done", "rejected", *FAILED)},
            "late": sum(r.outcome == "done" and not r.in_time for r in cls),
            "wait_p50_s": finite(pct([wait_or_inf(r) for r in cls if r.outcome != "rejected"], 0.50)),
            "wait_p99_s": finite(pct([wait_or_inf(r) for r in cls if r.outcome != "rejected"], 0.99)),
            "e2e_p99_s": finite(pct([e2e_or_inf(r) for r in cls if r.outcome != "rejected"], 0.99))}
    return {
        "high_e2e_p99_s": finite(high_burst), "high_e2e_p99_unloaded_s": finite(high_unloaded),
        "high_p99_over_unloaded": finite(high_burst / high_unloaded),
        "low_p99_wait_s": finite(pct([wait_or_inf(r) for r in low], 0.99)),
        "low_p99_wait_compliant_s": finite(pct([wait_or_inf(r) for r in low if r.job.tenant != ABUSER], 0.99)),
        "low_failed": sum(r.outcome in FAILED for r in low),
        "jain_vs_quota": jain, "served_over_fair_share": x,
        "goodput_tokens_per_s": sum(r.job.cost for r in records if r.in_time) / (len(burst) * ARRIVALS_S),
        "classes": classes,
    }


def misses(s: dict, best_goodput: float) -> list[str]:
    """The targets a policy's row misses (kvfleet's targets, applied to every row)."""
    out = []
    if s["goodput_tokens_per_s"] < best_goodput:
        out.append("goodput")
    if s["jain_vs_quota"] < JAIN_TARGET:
        out.append("jain")
    if s["high_p99_over_unloaded"] is None or s["high_p99_over_unloaded"] > HIGH_P99_TARGET:
        out.append("high p99")
    if s["low_p99_wait_s"] is None or s["low_p99_wait_s"] > LOW_AGING_BOUND_S:
        out.append("low wait")
    return out


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "failed" if v is None else format(v, spec)


def print_table(report: dict) -> None:
    print(f"\n{'policy':15} {'high p99 ×':>10} {'low p99 wait':>12} {'(compliant)':>11} {'low failed':>10} "
          f"{'jain':>6} {'goodput tok/s':>13} {'÷ best base':>11}  misses")
    for name, s in report["policies"].items():
        print(f"{name:15} {fmt(s['high_p99_over_unloaded']):>10} {fmt(s['low_p99_wait_s'], '.1f'):>12} "
              f"{fmt(s['low_p99_wait_compliant_s'], '.1f'):>11} {s['low_failed']:10d} {s['jain_vs_quota']:6.3f} "
              f"{s['goodput_tokens_per_s']:13.0f} {s['goodput_over_best_baseline']:11.2f}  "
              f"{', '.join(s['misses']) or '-'}")
    print(f"{'':15} {'class':7} {'done':>6} {'late':>5} {'shed':>5} {'expired':>7} {'wait p99':>9} {'e2e p99':>8}")
    for name, s in report["policies"].items():
        for cls, c in s["classes"].items():
            print(f"{name:15} {cls:7} {c['done']:6d} {c['late']:5d} {c['shed']:5d} {c['expired']:7d} "
                  f"{fmt(c['wait_p99_s']):>9} {fmt(c['e2e_p99_s']):>8}")


def plot(report: dict, timelines: dict[str, SimResult], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, backlog) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(report["policies"])
    metrics = [("goodput ÷ best baseline", lambda s: s["goodput_over_best_baseline"], None),
               ("Jain vs quota", lambda s: s["jain_vs_quota"], JAIN_TARGET),
               (f"{HIGH_P99_TARGET} ÷ high p99 ×", lambda s: HIGH_P99_TARGET / (s["high_p99_over_unloaded"] or math.inf), 1.0),
               ("aging bound ÷ low p99 wait", lambda s: LOW_AGING_BOUND_S / (s["low_p99_wait_s"] or math.inf), 1.0)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        s = report["policies"][name]
        bars.bar([k + i * width for k in range(len(metrics))], [min(2.0, f(s)) for _, f, _ in metrics], width, label=name)
    bars.axhline(1.0, color="black", lw=0.8)
    bars.set_xticks([k + width for k in range(len(metrics))], [m for m, _, _ in metrics], fontsize=8)
    bars.set_ylabel("≥ 1 meets kvfleet's target (capped at 2)")
    bars.set_title("5× burst with an abusive tenant")
    bars.legend()
    for name, result in timelines.items():
        backlog.plot([t for t, _, _ in result.timeline], [n for _, n, _ in result.timeline], label=name)
    backlog.axvspan(*BURST, color="grey", alpha=0.2, label="5× burst")
    backlog.set_xlabel("virtual time (s)")
    backlog.set_ylabel("jobs waiting (topics + buffer)")
    backlog.set_title("backlog, seed 0")
    backlog.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def burst_rate(admitted: list[float]) -> tuple[float, int, int]:
    """A burst's admission rate from its jobs' `admitted_at` stamps: (jobs/s, jobs
    counted, batches).

    One scheduler step stamps every job it admits with the same `admitted_at` (the step's
    clock, `SchedulerService.step`), so k steps give k distinct stamps and k − 1
    intervals between the first and the last. The first batch opens the clock: the jobs
    counted are those admitted after it (batches 2..k), over the time from the first
    admission to the last. Counting all jobs over that time, as the bench once did,
    credits k batches to k − 1 intervals."""
    first, last = min(admitted), max(admitted)
    if last == first:
        raise ValueError(f"all {len(admitted)} jobs were admitted in one batch: no interval to divide by")
    counted = sum(1 for a in admitted if a > first)
    return counted / (last - first), counted, len(set(admitted))


def live_dispatch(*, paced: int, burst: int, workers: int = LIVE_WORKERS, rate_per_s: float = 50.0,
                  timeout_s: float = 300.0) -> dict:
    """Dispatch through real Kafka + Redis + Celery with the scheduler/service.py loop
    (in a thread of this process) and `workers` real worker processes (builtin:tiny,
    `python -m workers.service`, started by the integration tests' launcher,
    tests/fleet.py), all under one fresh key prefix; each phase has its own topics and
    consumer group. Everything is removed afterwards, the workers stopped also on error.

    The budget is the workers' own heartbeats (their KV tokens and task slots), and each
    job's reservation is released when its worker finishes it. Jobs are short (the
    6-token prompt of "hello", LIVE_MAX_NEW_TOKENS new tokens) so the run measures
    dispatch more than inference, but the burst's admission rate is bounded by how fast
    the workers free their slots.

    Three stamps per job, all `time.time()` on this host:
    - submitted: just before the produce (this bench plays the API);
    - `admitted_at`: the clock the scheduler step read *before* its budget reads, the
      admission Lua (`JobStore.admit_many` → kvfleet/ledger.py `ADMIT`, which writes it
      into the job hash) and the Celery send, so it does not show that the admission
      is durable;
    - `started_at`: written by the worker's `JobStore.begin` with the clock it read on
      taking the task, i.e. after the task reached the Celery queue, which the
      scheduler sends only once the admission Lua has returned: the first stamp known
      to lie after the admission is durable and the task sent.

    Paced: one job every 1/rate s into a running scheduler; `dispatch_p50_ms` /
    `dispatch_p99_ms` are submitted → admitted_at (Kafka transit and the loop up to its
    step's clock, as before), `dispatch_to_start_p50_ms` / `_p99_ms` submitted →
    started_at (also the budget reads, the admission Lua, the send and the worker's
    pickup), `admitted_to_start_p50_ms` / `_p99_ms` the difference per job. Burst:
    `burst` jobs recorded queued, then produced at once into a running scheduler that
    has joined its group (a warm-up job went through it); `dispatch_burst_jobs_per_s` is
    `burst_rate()`: the jobs admitted after the first admission batch over the time from
    the first admission to the last.

    Real capacity brought out two scheduler bugs that left jobs queued for good (with
    an unlimited budget nothing waited in the buffer), both fixed in
    scheduler/service.py and tested in tests/test_scheduler_consumer.py: a rebalance
    dropped buffered jobs while kafka-python kept the read position of a partition it
    gave back to the same member (372 of 1,000 stuck), and a partition paused while
    kafka-python held fetched records for it was never fetched again once resumed (84 of
    1,000). The bench runs the default `max_buffered`, so pausing is exercised; the
    warm-up job before the burst only keeps the group's join out of the measured span.
    """
    addresses = kvfleet.infra.up()
    with _Workers(addresses, workers) as fleet:
        with fleet.scheduler("paced") as live:
            live.start()
            # One job through first: the scheduler has joined its group.
            fleet.stamps([live.submit(f"{fleet.tag}-warm", Priority.HIGH, flush=True)], live, timeout_s)
            ids = []
            for i in range(paced):
                ids.append(live.submit(f"{fleet.tag}-p{i}", list(Priority)[i % 3], flush=True))
                time.sleep(1.0 / rate_per_s)
            paced_stamps = fleet.stamps(ids, live, timeout_s)
        fleet.wait_released(timeout_s)  # the burst starts from an empty ledger
        with fleet.scheduler("burst") as live:
            # Into a scheduler that has joined its group (the join is not what is
            # measured): records first, then every job produced at once.
            live.start()
            fleet.stamps([live.submit(f"{fleet.tag}-bwarm", Priority.HIGH, flush=True)], live, timeout_s)
            jobs = [live.record(f"{fleet.tag}-b{i}", list(Priority)[i % 3]) for i in range(burst)]
            for job in jobs:
                live.produce(job)
            live.producer.flush()
            burst_stamps = fleet.stamps([job.job_id for job in jobs], live, timeout_s)
    to_admit = [a - s for s, a, _ in paced_stamps]
    to_start = [b - s for s, _, b in paced_stamps]
    admit_to_start = [b - a for _, a, b in paced_stamps]
    rate, counted, batches = burst_rate([a for _, a, _ in burst_stamps])
    ms = lambda values, q: pct(values, q) * 1000  # noqa: E731
    return {"dispatch_p50_ms": ms(to_admit, 0.50), "dispatch_p99_ms": ms(to_admit, 0.99),
            "dispatch_to_start_p50_ms": ms(to_start, 0.50), "dispatch_to_start_p99_ms": ms(to_start, 0.99),
            "admitted_to_start_p50_ms": ms(admit_to_start, 0.50), "admitted_to_start_p99_ms": ms(admit_to_start, 0.99),
            "dispatch_burst_jobs_per_s": rate, "dispatch_burst_jobs_counted": counted,
            "dispatch_burst_batches": batches, "dispatch_paced_jobs": paced, "dispatch_paced_jobs_per_s": rate_per_s,
            "dispatch_burst_jobs": burst, "dispatch_workers": fleet.workers, "dispatch_capacity_tokens": fleet.capacity,
            "dispatch_slots": fleet.slots, "dispatch_job_tokens": len(HELLO) + LIVE_MAX_NEW_TOKENS,
            "dispatch_max_buffered": fleet.settings.policy.max_buffered}


class _Workers:
    """Real workers under a fresh key prefix, with the means to stamp their jobs; on
    exit the workers are stopped and every key and topic of the prefix removed."""

    def __init__(self, addresses: dict[str, str], workers: int) -> None:
        self.tag = tag = f"bench{uuid.uuid4().hex[:8]}"
        self.workers = workers
        self.addresses = addresses
        self.urls = [addresses[name].rsplit("/", 1)[0] + f"/{LIVE_DB}" for name in ("redis-state", "redis-cache")]
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
        self.fleet = Fleet(prefix=tag, kafka=addresses["kafka"], redis_url=self.urls[0], cache_redis_url=self.urls[1],
                           log_dir=self.log_dir, model="builtin:tiny",
                           # The topology of a default deployment; WARNING: a log line per job
                           # would be work the bench does not measure.
                           extra_env={"KVFLEET_KAFKA_PARTITIONS": str(constants.PARTITIONS_PER_TOPIC),
                                      "KVFLEET_LOG_LEVEL": "WARNING"})
        self.settings = Settings.from_env(self.fleet.env)  # the workers' own settings: prefix, queues, Redis
        self.client = redis.Redis.from_url(self.urls[0])
        self.keys = self.settings.redis.keys
        self.topics: list[str] = []

    def __enter__(self) -> "_Workers":
        try:
            for _ in range(self.workers):
                self.fleet.start("worker")
            beats = self.fleet.wait_for(lambda: self._alive_beats(), f"{self.workers} worker heartbeats", 180.0)
        except BaseException:
            self.__exit__()
            raise
        self.capacity = sum(b.capacity_tokens for b in beats)
        self.slots = sum(b.slots for b in beats)
        return self

    def _alive_beats(self) -> list[WorkerHeartbeat]:
        self.fleet.assert_alive()
        beats = registry.live(self.client, self.keys)
        return beats if len(beats) >= self.workers else []

    def __exit__(self, *exc) -> None:
        try:
            self.fleet.stop()
        finally:
            _cleanup(self.settings.kafka, self.topics, self.urls, self.tag)
            self.client.close()
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def scheduler(self, phase: str) -> "_Scheduler":
        kafka = dataclasses.replace(self.settings.kafka, topic_prefix=f"{self.tag}-{phase}.requests",
                                    group=f"{self.tag}-{phase}-scheduler")
        self.topics += [*kafka.topics, kafka.dlq, kafka.results]
        return _Scheduler(self.settings.replace(kafka=kafka), self.client, f"{self.tag}-{phase}")

    def stamps(self, ids: list[str], live: "_Scheduler", timeout_s: float) -> list[tuple[float, float, float]]:
        """Wait until every job is done; per job (submitted, admitted_at, started_at).

        Fails early when jobs stay queued while nothing is reserved and the scheduler
        holds none of them: it dropped them (see `live_dispatch`), and no wait helps."""
        pending, found = list(ids), {}
        deadline = time.monotonic() + timeout_s
        progress = time.monotonic()
        while pending:
            with self.client.pipeline(transaction=False) as pipe:
                for job_id in pending:
                    pipe.hmget(self.keys.job(job_id), "state", "admitted_at", "started_at", "request")
                raw = pipe.execute()
            for job_id, (state, admitted, started, request) in zip(pending, raw):
                if state is not None and JobState(state.decode()).terminal:
                    if state != JobState.DONE.value.encode():
                        raise RuntimeError(f"job {job_id} ended {state.decode()}\n{self.fleet.logs()}")
                    found[job_id] = (decode_request(request).submitted_at, float(admitted), float(started))
            if len(found) + len(pending) > len(ids):  # some finished in this round
                progress = time.monotonic()
            pending = [job_id for job_id in pending if job_id not in found]
            states = Counter(s.decode() if s else "missing" for s, *_ in raw)
            stalled = time.monotonic() - progress > STALL_S and states.keys() <= {"queued", "done"}
            if pending and (time.monotonic() > deadline or stalled and live.holds_nothing()
                            and self.client.hlen(self.keys.ledger) == 0):
                why = "dropped by the scheduler" if stalled else f"not done after {timeout_s:.0f} s"
                raise TimeoutError(f"{len(pending)} of {len(ids)} jobs {why} (states {dict(states)}, "
                                   f"{self.client.hlen(self.keys.ledger)} reservations); the scheduler's log:\n"
                                   + "\n".join(live.notes) + f"\n{self.fleet.logs()}")
            # Not too often: the scheduler's thread shares this process's interpreter lock.
            time.sleep(0.2)
            self.fleet.assert_alive()
        return [found[job_id] for job_id in ids]

    def wait_released(self, timeout_s: float) -> None:
        self.fleet.wait_for(lambda: self.client.hlen(self.keys.ledger) == 0, "every reservation released", timeout_s)


class _Scheduler:
    """One phase's scheduler loop (a thread of this process) and the producer that plays the API."""

    def __init__(self, settings: Settings, client: redis.Redis, client_id: str) -> None:
        from scheduler import service  # the loop as it is at this moment

        self.settings = settings
        self.store = JobStore(client, settings.redis.keys)
        self.service = service.build(settings, client_id=f"{client_id}-scheduler")
        self.loop = threading.Thread(target=self.service.run, name="scheduler", daemon=True)
        self.producer = make_producer(settings.kafka, client_id=f"{client_id}-bench")
        #: What the loop logged (rebalances, warnings), but not its line per admitted job.
        self.notes: list[str] = []
        self._log = _Notes(self.notes)
        logging.getLogger("kvfleet.scheduler").addHandler(self._log)
        logging.getLogger("kvfleet.scheduler").setLevel(logging.INFO)

    def __enter__(self) -> "_Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.service.stopping.set()
        if self.loop.is_alive():
            self.loop.join(timeout=10)
        self.service.consumer.close()
        self.service.dlq.close(timeout=5)
        self.service.stop_relay()
        if self.service.wake is not None:
            self.service.wake.close()
        self.producer.close(timeout=5)
        logging.getLogger("kvfleet.scheduler").removeHandler(self._log)

    def start(self) -> None:
        self.loop.start()

    def holds_nothing(self) -> bool:
        return not (self.service.policy.pending() or self.service.waiting or self.service.resend)

    def submit(self, job_id: str, priority: Priority, *, flush: bool = False) -> str:
        """What the API does: record the job queued, then produce it (its prompt tokenized)."""
        self.produce(self.record(job_id, priority))
        if flush:
            self.producer.flush()  # paced: each job leaves at once, as the API's acks=all send does
        return job_id

    def record(self, job_id: str, priority: Priority) -> JobRequest:
        job = JobRequest(job_id=job_id, tenant="bench", priority=priority, model="builtin:tiny",
                         max_new_tokens=LIVE_MAX_NEW_TOKENS, submitted_at=time.time(), prompt_tokens=HELLO)
        self.store.create(job)
        return job

    def produce(self, job: JobRequest) -> None:
        self.producer.send(request_topic(self.settings.kafka.topic_prefix, job.priority), key=b"bench",
                           value=encode(job))


class _Notes(logging.Handler):
    def __init__(self, notes: list[str]) -> None:
        super().__init__(logging.INFO)
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() != "admitted":
            extra = {k: getattr(record, k) for k in ("partitions", "dropped", "error", "reason") if hasattr(record, k)}
            self.notes.append(f"{record.created:.3f} {record.levelname} {record.getMessage()} {extra or ''}")


def _cleanup(kafka: KafkaSettings, topics: list[str], redis_urls: list[str], tag: str) -> None:
    if topics:
        admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap, client_id=f"{tag}-admin")
        try:
            existing = set(admin.list_topics())
            admin.delete_topics([t for t in topics if t in existing])
        finally:
            admin.close()
    for url in redis_urls:  # job hashes, ledger, heartbeats, Celery queues; cold-tier blocks
        client = redis.Redis.from_url(url)
        try:
            for key in client.scan_iter(match=f"*{tag}*", count=1000):
                client.delete(key)
        finally:
            client.close()


#: live_dispatch()'s figures (a --sim-only run carries them over from the file it rewrites).
LIVE_KEYS = ("dispatch_p50_ms", "dispatch_p99_ms", "dispatch_to_start_p50_ms", "dispatch_to_start_p99_ms",
             "admitted_to_start_p50_ms", "admitted_to_start_p99_ms", "dispatch_burst_jobs_per_s")


def _earlier_live(path: Path) -> dict:
    """A --sim-only run keeps the live figures of the file it replaces (they measure code
    the simulation does not touch), with `live_command` naming the run that measured
    them; null when there are none."""
    try:
        earlier = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        earlier = {}
    if earlier.get(LIVE_KEYS[0]) is None:
        return dict.fromkeys(LIVE_KEYS) | {"live_command": None}
    kept = {k: v for k, v in earlier.items() if k.startswith(("dispatch_", "admitted_to_start_"))}
    return kept | {"live_command": earlier.get("live_command") or earlier.get("command")}


def print_live(r: dict) -> None:
    print(f"\nlive dispatch (Kafka → scheduler/service.py → Redis + Celery → {r['dispatch_workers']} "
          f"builtin:tiny workers, {r['dispatch_capacity_tokens']:,} KV tokens and {r['dispatch_slots']} slots; "
          f"{r['dispatch_job_tokens']}-token jobs), paced at {r['dispatch_paced_jobs_per_s']:.0f} jobs/s:\n"
          f"  submission → admitted_at (the step's clock, before the admission Lua): "
          f"p50 {r['dispatch_p50_ms']:.1f} ms, p99 {r['dispatch_p99_ms']:.1f} ms\n"
          f"  submission → started_at (worker began it; admission durable, task sent): "
          f"p50 {r['dispatch_to_start_p50_ms']:.1f} ms, p99 {r['dispatch_to_start_p99_ms']:.1f} ms\n"
          f"  burst of {r['dispatch_burst_jobs']}: {r['dispatch_burst_jobs_per_s']:.0f} jobs/s admitted "
          f"({r['dispatch_burst_jobs_counted']} jobs after the first of {r['dispatch_burst_batches']} batches, "
          f"first → last admission)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 10")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--decode-step-slack", type=float, default=None,
                        help="the engines' decode_step_slack (default: EngineConfig's); for sweeps")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed .. first-seed + seeds - 1 (another draw of the same workload)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--sim-only", action="store_true", help="skip live_dispatch (no Kafka needed)")
    parser.add_argument("--live-only", action="store_true", help="only live_dispatch; print, write nothing")
    parser.add_argument("--live-workers", type=int, default=LIVE_WORKERS, help="worker processes of live_dispatch")
    args = parser.parse_args()
    live_sizes = dict(paced=100 if args.quick else 300, burst=1000 if args.quick else 3000, workers=args.live_workers)
    if args.live_only:
        print(json.dumps(live_dispatch(**live_sizes), indent=2))
        return
    seeds = args.seeds or (3 if args.quick else 10)
    seed_range = range(args.first_seed, args.first_seed + seeds)
    service = SERVICE if args.decode_step_slack is None else \
        dataclasses.replace(SERVICE, decode_step_slack=args.decode_step_slack)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    runs = {scenario: run(scenario, seed_range, service) for scenario in SCENARIOS}
    policies = {name: summarize(runs["burst"][name], runs["unloaded"][name]) for name in runs["burst"]}
    best_baseline = max(policies[b]["goodput_tokens_per_s"] for b in BASELINES)
    best = max(s["goodput_tokens_per_s"] for s in policies.values())
    for s in policies.values():
        s["goodput_over_best_baseline"] = s["goodput_tokens_per_s"] / best_baseline
        s["misses"] = misses(s, best)
    report: dict = {"seeds": seeds, "first_seed": args.first_seed,
                    "service": {"a_s": service.a_s, "b_s_per_token": service.b_s_per_token,
                                "workers": service.workers, "decode_step_slack": finite(service.decode_step_slack)},
                    "low_aging_bound_s": LOW_AGING_BOUND_S}
    for name, s in policies.items():
        for key in ("high_p99_over_unloaded", "jain_vs_quota", "goodput_over_best_baseline", "low_p99_wait_s",
                    "low_p99_wait_compliant_s"):
            report[f"{name}_{key}"] = s[key]
    kv = policies["kvfleet"]
    alone = high_alone(seed_range, service)
    report.update(high_alone_e2e_p99_s=finite(alone),
                  high_alone_p99_over_unloaded=finite(alone / kv["high_e2e_p99_unloaded_s"]))
    report.update(targets_met=not kv["misses"], kvfleet_misses=kv["misses"], policies=policies,
                  sim_seconds=round(time.perf_counter() - started, 1),
                  command=" ".join(["python", "bench/scheduler.py", *sys.argv[1:]]))
    print_table(report)
    print(f"\nthe burst's high jobs alone on the fleet: high p99 {fmt(report['high_alone_e2e_p99_s'])} s, "
          f"{fmt(report['high_alone_p99_over_unloaded'])} × kvfleet's unloaded")
    if args.sim_only:
        report.update(_earlier_live(args.out / "scheduler.json"))
    else:
        report.update(live_dispatch(**live_sizes), live_command=report["command"])
        print_live(report)
    print(f"\nkvfleet: targets {'met' if report['targets_met'] else 'MISSED: ' + ', '.join(kv['misses'])} "
          f"({report['sim_seconds']} s of simulation)")
    (args.out / "scheduler.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, {name: results[0] for name, results in runs["burst"].items()}, args.out / "scheduler.png")
    print(f"wrote {args.out / 'scheduler.json'} and {args.out / 'scheduler.png'}")


if __name__ == "__main__":
    main()
