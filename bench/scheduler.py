"""Scheduler benchmark: kvfleet's admission policy against FIFO and strict priority,
replayed through the simulator (bench/sim/simulator.py) with a virtual clock.

    python bench/scheduler.py [--quick] [--seeds N] [--out bench/results]

Fleet: 4 workers × 32k KV tokens. Workload: 10% high / 50% normal / 40% low jobs,
prompts from 32 tokens to near the 8k context limit, three tenants (gold 30%, silver
45%, bronze 25% of the jobs). Two scenarios, each replayed for every policy with the
same jobs: "unloaded" (30% load for 120 s) and "burst" (50% load, then 10 s at 5× what
the fleet can serve, then 50% until 120 s). Each scenario runs once per seed and the
percentiles pool the seeds.

Targets: under the burst, kvfleet's high p99 end-to-end ≤ 1.5 × its unloaded value, and
no class starved: every job of a class admitted (none expired waiting) with the class's
p99 wait within its aging bound (`PolicyConfig.<class>.max_wait_s`).

Jain's fairness index is taken across tenants over the burst: per tenant, the fraction
of the tokens it submitted during the burst that were admitted during the burst. 1.0
means every tenant got the same fraction of what it asked for; tiers deliberately trade
some of it (gold's reserve, bronze's hard limit and shedding).

`live_dispatch()` is the one part that is not simulated: jobs go through the real
Kafka, the scheduler loop of `scheduler/service.py` (policy, ledger reservation in the
job store's admission script, batched Celery sends), the Redis job store and the Celery
broker, with a published heartbeat as the budget and no worker (it measures dispatch,
not inference). It gives `dispatch_p50_ms` / `dispatch_p99_ms` (submission → admitted,
paced at 50 jobs/s) and `dispatch_jobs_per_s` (a burst produced first, then consumed:
first admission → last admission). `--sim-only` skips it; `--live-only` runs only it
and writes nothing.

Prints tables, writes <out>/scheduler.json and <out>/scheduler.png.
"""

from __future__ import annotations

import argparse
import json
import sys
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
from kvfleet.constants import request_topic  # noqa: E402
from kvfleet import registry  # noqa: E402
from kvfleet.contracts import JobRequest, Priority, WorkerHeartbeat, encode  # noqa: E402
from kvfleet.jobstore import JobStore  # noqa: E402
from kvfleet.kafka import make_producer  # noqa: E402
from kvfleet.settings import KafkaSettings, RedisSettings, Settings  # noqa: E402
from kvfleet.settings import PolicyConfig  # noqa: E402
from kvfleet.tenancy import Tenant, Tier  # noqa: E402
from kvfleet.tokenizer import ByteTokenizer  # noqa: E402
from scheduler.policy import Policy  # noqa: E402
from bench.sim.baselines import FifoPolicy, StrictPriorityPolicy  # noqa: E402
from bench.sim.simulator import JobRecord, Phase, SimResult, Workload, make_jobs, simulate  # noqa: E402

POLICIES = (Policy, FifoPolicy, StrictPriorityPolicy)
HELLO = ByteTokenizer().encode("hello")  # builtin:tiny's tokens for "hello", as the API sends them
CONFIG = PolicyConfig()
TENANTS = {"gold-co": Tenant(name="gold-co", tier=Tier.GOLD, tokens_per_minute=10**9)}  # gold's reserve: the default
BURST = (30.0, 40.0)
SCENARIOS = {
    "unloaded": (Phase(0, 120, 0.3),),
    "burst": (Phase(0, BURST[0], 0.5), Phase(*BURST, 5.0), Phase(BURST[1], 120, 0.5)),
}
HIGH_P99_TARGET = 1.5
LIVE_DB = 3  # tests use Redis database 1, the kvstore bench 2, the demo 0


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


def run(scenario: str, seeds: int) -> dict[str, list[SimResult]]:
    results: dict[str, list[SimResult]] = {p.name: [] for p in POLICIES}
    for seed in range(seeds):
        workload = Workload(seed=seed, phases=SCENARIOS[scenario])
        jobs = make_jobs(workload)
        for policy in POLICIES:
            results[policy.name].append(simulate(policy(CONFIG, TENANTS), jobs, capacity=workload.capacity_tokens,
                                                 service=workload.service))
    return results


def class_stats(records: list[JobRecord]) -> dict:
    waits = [r.wait for r in records if r.wait is not None]
    e2e = [r.e2e for r in records if r.e2e is not None]
    outcomes = {o: sum(r.outcome == o for r in records) for o in ("done", "rejected", "shed", "expired", "waiting")}
    return {"jobs": len(records), **outcomes,
            "wait_p50_s": pct(waits, 0.50), "wait_p99_s": pct(waits, 0.99),
            "e2e_p50_s": pct(e2e, 0.50), "e2e_p99_s": pct(e2e, 0.99)}


def jain_over_burst(runs: list[SimResult]) -> float:
    submitted: dict[str, int] = {}
    admitted: dict[str, int] = {}
    for result in runs:
        for r in result.records:
            if BURST[0] <= r.job.enqueued_at < BURST[1]:
                submitted[r.job.tenant] = submitted.get(r.job.tenant, 0) + r.job.cost
                if r.admitted_at is not None and r.admitted_at < BURST[1]:
                    admitted[r.job.tenant] = admitted.get(r.job.tenant, 0) + r.job.cost
    x = [admitted.get(t, 0) / submitted[t] for t in sorted(submitted)]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else 0.0


def summarize(runs: list[SimResult]) -> dict:
    records = [r for result in runs for r in result.records]
    done = [r for r in records if r.outcome == "done"]
    span = sum(max(r.finished_at for r in res.records if r.finished_at) for res in runs)
    starved = []
    for p in Priority:
        cls = [r for r in records if r.job.priority is p]
        never = any(r.outcome in ("expired", "waiting") for r in cls)
        p99 = pct([r.wait for r in cls if r.wait is not None], 0.99)
        if never or p99 is None or p99 > CONFIG.of(p).max_wait_s:
            starved.append(p.value)
    return {
        "classes": {p.value: class_stats([r for r in records if r.job.priority is p]) for p in Priority},
        "high_e2e_p99_by_tier_s": {t.value: pct([r.e2e for r in records if r.job.priority is Priority.HIGH
                                                 and r.job.tier is t and r.e2e is not None], 0.99) for t in Tier},
        "throughput_jobs_per_s": len(done) / span,
        "throughput_tokens_per_s": sum(r.job.cost for r in done) / span,
        "shed": sum(r.outcome == "shed" for r in records),
        "shed_by_tier": {t.value: sum(r.outcome == "shed" and r.job.tier is t for r in records) for t in Tier},
        "starved_classes": starved,
    }


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(report: dict) -> None:
    for scenario in SCENARIOS:
        print(f"\n== {scenario} ==")
        print(f"{'policy':8} {'class':7} {'done':>6} {'shed':>5} {'wait p50':>9} {'wait p99':>9} "
              f"{'e2e p50':>8} {'e2e p99':>8}")
        for name, s in report["scenarios"][scenario].items():
            for cls, c in s["classes"].items():
                print(f"{name:8} {cls:7} {c['done']:6d} {c['shed']:5d} {fmt(c['wait_p50_s']):>9} "
                      f"{fmt(c['wait_p99_s']):>9} {fmt(c['e2e_p50_s']):>8} {fmt(c['e2e_p99_s']):>8}")
        print(f"{'policy':8} {'jobs/s':>7} {'tokens/s':>9} {'jain':>5} {'high p99 ×':>10}  starved")
        for name, s in report["scenarios"][scenario].items():
            print(f"{name:8} {s['throughput_jobs_per_s']:7.1f} {s['throughput_tokens_per_s']:9.0f} "
                  f"{fmt(s.get('jain_fairness'), '.3f'):>5} {fmt(s.get('high_p99_burst_over_unloaded')):>10}  "
                  f"{','.join(s['starved_classes']) or '-'}")


def plot(report: dict, timelines: dict[str, SimResult], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, backlog) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(report["scenarios"]["burst"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        classes = report["scenarios"]["burst"][name]["classes"]
        bars.bar([k + i * width for k in range(3)], [classes[p.value]["e2e_p99_s"] or 0 for p in Priority],
                 width, label=name)
    unloaded = report["scenarios"]["unloaded"]["kvfleet"]["classes"]
    bars.scatter([k + width for k in range(3)], [unloaded[p.value]["e2e_p99_s"] for p in Priority],
                 color="black", marker="_", s=600, zorder=3, label="kvfleet unloaded")
    bars.set_xticks([k + width for k in range(3)], [p.value for p in Priority])
    bars.set_ylabel("p99 end-to-end (s)")
    bars.set_title("5× burst: p99 end-to-end by class")
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


def live_dispatch(*, paced: int, burst: int, rate_per_s: float = 50.0, timeout_s: float = 120.0) -> dict:
    """Dispatch through real Kafka + Redis + Celery with the scheduler/service.py loop,
    each phase under a fresh topic and key prefix that are deleted afterwards.

    The budget is a published heartbeat (no worker runs, so no reservation is released:
    the ledger grows to the jobs of the phase, the costliest case for its atomic sum).
    Paced: one job every 1/rate s into a running scheduler; its latency is submission
    (just before the produce) → admitted_at (written with the reservation, just before
    the task is sent): Kafka transit plus what the scheduler adds. Burst: `burst` jobs
    produced first, then the scheduler started; jobs/s from its first admission to its
    last: the loop's own throughput, Kafka fetch included.
    """
    addresses = kvfleet.infra.up()
    with _live(addresses) as live:
        live.start()
        live.admitted([live.submit(f"{live.tag}-warm", Priority.HIGH, flush=True)])  # joined the group
        ids = []
        for i in range(paced):
            ids.append(live.submit(f"{live.tag}-p{i}", list(Priority)[i % 3], flush=True))
            time.sleep(1.0 / rate_per_s)
        delays = sorted(a - s for a, s in zip(live.admitted(ids, timeout_s), live.submitted(ids)))
    with _live(addresses) as live:
        ids = [live.submit(f"{live.tag}-b{i}", list(Priority)[i % 3]) for i in range(burst)]
        live.producer.flush()
        live.start()
        admitted = live.admitted(ids, timeout_s)
        span = max(admitted) - min(admitted)
    return {"dispatch_p50_ms": pct(delays, 0.50) * 1000, "dispatch_p99_ms": pct(delays, 0.99) * 1000,
            "dispatch_jobs_per_s": burst / span, "dispatch_paced_jobs": paced, "dispatch_burst_jobs": burst}


class _live:
    """One live phase: a fresh prefix, a scheduler thread, a producer; all removed after."""

    def __init__(self, addresses: dict[str, str]) -> None:
        from scheduler import service  # the loop as it is at this moment

        self.tag = tag = f"bench{uuid.uuid4().hex[:8]}"
        url = addresses["redis-state"].rsplit("/", 1)[0] + f"/{LIVE_DB}"
        self.settings = Settings().replace(
            kafka=KafkaSettings(bootstrap=addresses["kafka"], topic_prefix=f"{tag}.requests", group=f"{tag}-scheduler"),
            redis=RedisSettings(url=url, key_prefix=tag))
        self.client = redis.Redis.from_url(url)
        self.store = JobStore(self.client, self.settings.redis.keys)
        beat = WorkerHeartbeat(worker_id="bench", capacity_tokens=10**9)
        registry.publish(self.client, self.settings.redis.keys, beat, ttl_ms=3_600_000)
        self.scheduler = service.build(self.settings, client_id=f"{tag}-scheduler")
        self.loop = threading.Thread(target=self.scheduler.run, name="scheduler", daemon=True)
        self.producer = make_producer(self.settings.kafka, client_id=f"{tag}-bench")

    def __enter__(self) -> "_live":
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler.stopping.set()
        if self.loop.is_alive():
            self.loop.join(timeout=10)
        self.scheduler.consumer.close()
        self.scheduler.dlq.close(timeout=5)
        self.producer.close(timeout=5)
        _cleanup(self.settings, self.client, self.tag)

    def start(self) -> None:
        self.loop.start()

    def submit(self, job_id: str, priority: Priority, *, flush: bool = False) -> str:
        """What the API does: record the job queued, then produce it (its prompt tokenized)."""
        job = JobRequest(job_id=job_id, tenant="bench", priority=priority, model="builtin:tiny", max_new_tokens=16,
                         submitted_at=time.time(), prompt_tokens=HELLO)
        self.store.create(job)
        self.producer.send(request_topic(self.settings.kafka.topic_prefix, priority), key=b"bench", value=encode(job))
        if flush:
            self.producer.flush()  # paced: each job leaves at once, as the API's acks=all send does
        return job_id

    def admitted(self, ids: list[str], timeout_s: float = 60.0) -> list[float]:
        """Wait until every job is admitted; their admission times."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.client.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(self.settings.redis.keys.job(job_id), "admitted_at")
                raw = pipe.execute()
            if all(raw):
                return [float(v) for v in raw]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not v for v in raw)} of {len(ids)} jobs not admitted after {timeout_s:.0f} s")
            time.sleep(0.05)

    def submitted(self, ids: list[str]) -> list[float]:
        return [self.store.request(job_id).submitted_at for job_id in ids]


def _cleanup(settings: Settings, client: redis.Redis, tag: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, client_id=f"{tag}-admin")
    try:
        admin.delete_topics([*settings.kafka.topics, settings.kafka.dlq])
    finally:
        admin.close()
    for key in client.scan_iter(match=f"*{tag}*", count=1000):
        client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 10")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--sim-only", action="store_true", help="skip live_dispatch (no Kafka needed)")
    parser.add_argument("--live-only", action="store_true", help="only live_dispatch; print, write nothing")
    args = parser.parse_args()
    if args.live_only:
        live = live_dispatch(paced=100 if args.quick else 300, burst=1000 if args.quick else 3000)
        print(json.dumps(live, indent=2))
        return
    seeds = args.seeds or (3 if args.quick else 10)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    runs = {scenario: run(scenario, seeds) for scenario in SCENARIOS}
    report: dict = {"seeds": seeds, "scenarios": {}}
    for scenario, by_policy in runs.items():
        report["scenarios"][scenario] = {name: summarize(results) for name, results in by_policy.items()}
    for name in report["scenarios"]["burst"]:
        burst, unloaded = report["scenarios"]["burst"][name], report["scenarios"]["unloaded"][name]
        burst["jain_fairness"] = jain_over_burst(runs["burst"][name])
        burst["high_p99_burst_over_unloaded"] = (burst["classes"]["high"]["e2e_p99_s"]
                                                 / unloaded["classes"]["high"]["e2e_p99_s"])
    kv = report["scenarios"]["burst"]["kvfleet"]
    report.update(
        high_p99_burst_over_unloaded=kv["high_p99_burst_over_unloaded"],
        starved_classes=kv["starved_classes"],
        jain_fairness=kv["jain_fairness"],
        targets_met=kv["high_p99_burst_over_unloaded"] <= HIGH_P99_TARGET and not kv["starved_classes"],
        sim_seconds=round(time.perf_counter() - started, 1),
        command=" ".join(["python", "bench/scheduler.py", *sys.argv[1:]]),
    )
    print_tables(report)
    if args.sim_only:
        report.update(dispatch_jobs_per_s=None, dispatch_p50_ms=None, dispatch_p99_ms=None)
    else:
        report.update(live_dispatch(paced=100 if args.quick else 300, burst=1000 if args.quick else 3000))
        print(f"\nlive dispatch (Kafka → scheduler/service.py → Redis + Celery): submission → admitted "
              f"p50 {report['dispatch_p50_ms']:.1f} ms, p99 {report['dispatch_p99_ms']:.1f} ms at 50 jobs/s; "
              f"{report['dispatch_jobs_per_s']:.0f} jobs/s for a burst of {report['dispatch_burst_jobs']}")
    print(f"\nkvfleet under the burst: high p99 e2e = {kv['high_p99_burst_over_unloaded']:.2f} × unloaded "
          f"(target ≤ {HIGH_P99_TARGET}), starved: {kv['starved_classes'] or 'none'}, "
          f"Jain {kv['jain_fairness']:.3f}; targets {'met' if report['targets_met'] else 'MISSED'}")
    (args.out / "scheduler.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, {name: results[0] for name, results in runs["burst"].items()}, args.out / "scheduler.png")
    print(f"wrote {args.out / 'scheduler.json'} and {args.out / 'scheduler.png'}")


if __name__ == "__main__":
    main()
