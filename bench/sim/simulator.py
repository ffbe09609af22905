"""Replays a workload through an admission policy with a virtual clock.

The fleet is modelled as its token budget: a job holds `cost` tokens from admission
until it finishes, `ServiceModel.seconds()` later (a floor plus time per prompt and
per generated token; a job's speed does not depend on what else runs). Each priority
topic has one partition per tenant (Kafka keys by tenant), read round-robin into the
policy's buffer unless the policy paused it. Every `tick_s` the loop does what the
service does around a poll: finish jobs, poll, `schedule()`, start the admitted.

Deterministic: the same `Workload` (seed included) gives the same jobs and results.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvfleet.contracts import Priority
from scheduler.policy import Budget, Partition, PendingJob, Policy
from kvfleet.tenancy import Tier


@dataclass(frozen=True)
class ServiceModel:
    """Seconds a job runs once admitted. The defaults are a mid-size model on one GPU:
    ~10k prompt tokens/s prefill, ~65 tokens/s decode per sequence."""

    floor_s: float = 0.15  # scheduling, dispatch and the first forward pass
    prefill_s_per_token: float = 1e-4
    decode_s_per_token: float = 0.015

    def seconds(self, prompt_tokens: int, max_new_tokens: int) -> float:
        return self.floor_s + prompt_tokens * self.prefill_s_per_token + max_new_tokens * self.decode_s_per_token


@dataclass(frozen=True)
class Phase:
    start_s: float
    end_s: float
    #: Offered load as a multiple of what the fleet can serve (token-seconds per second
    #: over capacity): 1.0 keeps it exactly busy, 5.0 is the burst.
    load: float


@dataclass(frozen=True)
class SimTenant:
    name: str
    tier: Tier
    traffic: float  # fraction of all jobs


@dataclass(frozen=True)
class Workload:
    seed: int = 0
    capacity_tokens: int = 4 * 32_768  # four workers with 32k KV tokens each
    context_limit: int = 8192
    phases: tuple[Phase, ...] = (Phase(0, 30, 0.5), Phase(30, 40, 5.0), Phase(40, 120, 0.5))
    tenants: tuple[SimTenant, ...] = (
        SimTenant("gold-co", Tier.GOLD, 0.30),
        SimTenant("silver-co", Tier.SILVER, 0.45),
        SimTenant("bronze-co", Tier.BRONZE, 0.25),
    )
    #: Share of jobs per class: high is the interactive premium traffic.
    mix: tuple[tuple[Priority, float], ...] = ((Priority.HIGH, 0.10), (Priority.NORMAL, 0.50), (Priority.LOW, 0.40))
    #: Class ceilings the generator keeps to, except for `oversize` of the jobs.
    ceilings: tuple[tuple[Priority, int], ...] = ((Priority.HIGH, 8192), (Priority.NORMAL, 4096), (Priority.LOW, 1024))
    oversize: float = 0.01
    timeout_s: float = 600.0  # deadline = arrival + this (the API's default SLA)
    service: ServiceModel = ServiceModel()


def _shape(rng: random.Random, w: Workload) -> tuple[Priority, SimTenant, int, int]:
    """(priority, tenant, prompt_tokens, max_new_tokens) of one job."""
    priority = rng.choices([p for p, _ in w.mix], [f for _, f in w.mix])[0]
    tenant = rng.choices(w.tenants, [t.traffic for t in w.tenants])[0]
    max_new = int(math.exp(rng.uniform(math.log(16), math.log(512))))
    kind = rng.random()
    if kind < 0.70:
        prompt = rng.randint(32, 512)  # chat turns
    elif kind < 0.92:
        prompt = rng.randint(512, 2048)  # documents
    else:
        prompt = rng.randint(2048, w.context_limit - max_new)  # near the context limit
    if rng.random() >= w.oversize:
        prompt = max(1, min(prompt, dict(w.ceilings)[priority] - max_new))
    return priority, tenant, prompt, max_new


def make_jobs(w: Workload) -> list[PendingJob]:
    """Poisson arrivals per phase, at the rate that offers `load` × the fleet's capacity."""
    probe = random.Random(w.seed ^ 0x5EED)
    sample = [_shape(probe, w) for _ in range(20_000)]
    mean_token_s = sum((p + n) * w.service.seconds(p, n) for _, _, p, n in sample) / len(sample)
    rng = random.Random(w.seed)
    jobs: list[PendingJob] = []
    partition = {t.name: k for k, t in enumerate(w.tenants)}
    for phase in w.phases:
        rate = phase.load * w.capacity_tokens / mean_token_s  # jobs per second
        t = phase.start_s + rng.expovariate(rate)
        while t < phase.end_s:
            priority, tenant, prompt, max_new = _shape(rng, w)
            jobs.append(PendingJob(
                job_id=f"j{len(jobs):06d}", tenant=tenant.name, tier=tenant.tier, priority=priority,
                prompt_tokens=prompt, max_new_tokens=max_new, enqueued_at=t, deadline=t + w.timeout_s,
                partition=partition[tenant.name]))
            t += rng.expovariate(rate)
    return jobs


@dataclass
class JobRecord:
    job: PendingJob
    outcome: str = "waiting"  # done | expired | rejected | shed | waiting (never decided)
    admitted_at: Optional[float] = None
    finished_at: Optional[float] = None  # done: finished; otherwise when it left

    @property
    def wait(self) -> Optional[float]:
        return None if self.admitted_at is None else self.admitted_at - self.job.enqueued_at

    @property
    def e2e(self) -> Optional[float]:
        return None if self.outcome != "done" else self.finished_at - self.job.enqueued_at


@dataclass
class SimResult:
    policy: str
    records: list[JobRecord]
    #: (t, jobs waiting in topics and buffer, tokens in use) once per virtual second.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


class _Fleet:
    """The token budget and the jobs running on it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.by_tenant: dict[str, int] = {}
        self.by_class: dict[Priority, int] = {}
        self.running: list[tuple[float, int, PendingJob]] = []  # heap by finish time
        self._seq = itertools.count()

    def start(self, job: PendingJob, finish_at: float) -> None:
        self._add(job, job.cost)
        heapq.heappush(self.running, (finish_at, next(self._seq), job))

    def finish_until(self, now: float) -> None:
        while self.running and self.running[0][0] <= now:
            _, _, job = heapq.heappop(self.running)
            self._add(job, -job.cost)

    def _add(self, job: PendingJob, tokens: int) -> None:
        self.in_use += tokens
        self.by_tenant[job.tenant] = self.by_tenant.get(job.tenant, 0) + tokens
        self.by_class[job.priority] = self.by_class.get(job.priority, 0) + tokens

    def budget(self) -> Budget:
        return Budget(self.capacity, self.in_use, dict(self.by_tenant), dict(self.by_class))


class _Topics:
    """The three priority topics, one FIFO per partition."""

    def __init__(self) -> None:
        self.partitions: dict[Partition, deque[PendingJob]] = {}

    def produce(self, job: PendingJob) -> None:
        self.partitions.setdefault((job.priority, job.partition), deque()).append(job)

    def poll(self, priority: Priority, room: int, paused: frozenset[Partition]) -> list[PendingJob]:
        """Round-robin over the class's unpaused partitions until `room` jobs; as a real
        poll, a readable partition yields at least its next job even with no room."""
        ready = [q for key, q in sorted(self.partitions.items()) if key[0] is priority and key not in paused and q]
        out = [q.popleft() for q in ready]
        while len(out) < room and any(ready):
            for q in ready:
                if q and len(out) < room:
                    out.append(q.popleft())
        return out

    def __len__(self) -> int:
        return sum(len(q) for q in self.partitions.values())


def simulate(policy: Policy, jobs: list[PendingJob], *, capacity: int, service: ServiceModel,
             tick_s: float = 0.05, horizon_s: float = 3600.0) -> SimResult:
    """Run until every job is decided and finished (or `horizon_s` after the last arrival)."""
    arrivals = sorted(jobs, key=lambda j: (j.enqueued_at, j.job_id))
    records = {j.job_id: JobRecord(j) for j in arrivals}
    fleet, topics = _Fleet(capacity), _Topics()
    result = SimResult(policy.name, list(records.values()))
    end = (arrivals[-1].enqueued_at if arrivals else 0.0) + horizon_s
    next_sample, i, step = 0.0, 0, 0
    while (i < len(arrivals) or len(topics) or policy.pending() or fleet.running) and step * tick_s <= end:
        now = step * tick_s  # a multiple, not a running sum: no drift in the clock
        fleet.finish_until(now)
        while i < len(arrivals) and arrivals[i].enqueued_at <= now:
            topics.produce(arrivals[i])
            i += 1
        for p in Priority:
            for job in topics.poll(p, policy.config.max_buffered - policy.pending(p), policy.paused):
                policy.add(job)
        decision = policy.schedule(now, fleet.budget())
        for job in decision.admit:
            finish = now + service.seconds(job.prompt_tokens, job.max_new_tokens)
            fleet.start(job, finish)
            records[job.job_id].admitted_at, records[job.job_id].finished_at = now, finish
            records[job.job_id].outcome = "done"
        for outcome, verdicts in (("expired", decision.expire), ("rejected", decision.reject), ("shed", decision.shed)):
            for v in verdicts:
                records[v.job.job_id].outcome, records[v.job.job_id].finished_at = outcome, now
        if now >= next_sample:
            result.timeline.append((now, len(topics) + policy.pending(), fleet.in_use))
            next_sample += 1.0
        step += 1
        if not (len(topics) or policy.pending() or fleet.running) and i < len(arrivals):
            step = max(step, math.ceil(arrivals[i].enqueued_at / tick_s))  # idle: skip ahead
    return result
