"""Replays a workload through an admission policy with a virtual clock.

The fleet is its token budget: a job holds `cost` tokens from admission until it
finishes. How long it runs is the service model's:
- `BatchService` (the benchmark's): each worker runs one continuous batch; a step
  computes one token for every decoding job on it plus the whole prompt of every job
  joining it, and takes t(n) = a + b·n seconds for its n tokens (the engine's own
  step-cost model, workers/engine/step_cost.py). So a job's time grows with the batch
  it shares: every co-running job adds b to each of its steps, and every prompt that
  joins its worker stalls it for b·prompt_tokens.
- `ServiceModel`: a fixed time per job (a floor plus time per prompt and per generated
  token), whatever else runs; the policy tests use it for exact timings.
Each priority topic has one partition per tenant (Kafka keys by tenant), read
round-robin into the policy's buffer unless the policy paused it. Every `tick_s` the
loop does what the service does around a poll: finish jobs, poll, `schedule()`, start
the admitted.

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
class BatchService:
    """Workers running continuous batches with a step time of a + b·n_tokens.

    Not modelled: chunked prefill (a prompt is computed in the step it joins), the
    engine's per-step token budget and sequence limit, and its priority guard
    (`priority_step_slack`: lower-class tokens held back while a higher class runs).
    A job is placed on the worker with the fewest reserved tokens; the budget is the
    fleet's, so one worker may hold more than a quarter of it."""

    #: Defaults: builtin:bench on one CPU thread, from bench/results/engine.json's
    #: uncontended runs (step = concurrency / tokens_per_s at 1, 8, 32 and 64
    #: concurrent: 3.8, 9.7, 27.7, 53 ms): a ≈ 3 ms, b ≈ 0.78 ms per token.
    #: `python -m bench.sim.step_cost_probe` measures them again.
    a_s: float = 0.003
    b_s_per_token: float = 0.00078
    workers: int = 4
    #: Jobs a worker runs at once (its engine's max_num_seqs, its Celery threads); the
    #: rest wait on it, first come first served, as tasks in its Celery queue do. 0: no limit.
    max_seqs: int = 0

    def step_s(self, tokens: int) -> float:
        return self.a_s + self.b_s_per_token * tokens

    def worker_seconds_per_job(self, prompt_tokens: float, max_new_tokens: float, jobs_per_worker: float) -> float:
        """Worker time one job uses with `jobs_per_worker` decoding beside it: its
        tokens' b, plus its share of the fixed cost of the steps it decodes in."""
        return self.a_s * max_new_tokens / max(1.0, jobs_per_worker) + self.b_s_per_token * (
            prompt_tokens + max_new_tokens)


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
    traffic: float  # relative weight of its jobs among all tenants'
    quota: float = 0.0  # its entitled fraction of the fleet (the Jain index's weight)


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
    #: Per-class deadlines (seconds after arrival); a class not listed uses `timeout_s`.
    timeouts: tuple[tuple[Priority, float], ...] = ()
    service: ServiceModel | BatchService = ServiceModel()

    def timeout(self, priority: Priority) -> float:
        return dict(self.timeouts).get(priority, self.timeout_s)


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


def jobs_per_s_at_full_load(w: Workload) -> float:
    """The rate of the mean job the fleet serves with its budget full (load 1.0)."""
    probe = random.Random(w.seed ^ 0x5EED)
    sample = [_shape(probe, w) for _ in range(20_000)]
    if isinstance(w.service, BatchService):
        prompt = sum(p for _, _, p, _ in sample) / len(sample)
        new = sum(n for _, _, _, n in sample) / len(sample)
        per_worker = w.capacity_tokens / w.service.workers / (prompt + new)  # jobs decoding side by side
        return w.service.workers / w.service.worker_seconds_per_job(prompt, new, per_worker)
    mean_token_s = sum((p + n) * w.service.seconds(p, n) for _, _, p, n in sample) / len(sample)
    return w.capacity_tokens / mean_token_s


def make_jobs(w: Workload) -> list[PendingJob]:
    """Poisson arrivals per phase, at the rate that offers `load` × what the fleet serves."""
    full = jobs_per_s_at_full_load(w)
    rng = random.Random(w.seed)
    jobs: list[PendingJob] = []
    partition = {t.name: k for k, t in enumerate(w.tenants)}
    for phase in w.phases:
        rate = phase.load * full  # jobs per second
        t = phase.start_s + rng.expovariate(rate)
        while t < phase.end_s:
            priority, tenant, prompt, max_new = _shape(rng, w)
            jobs.append(PendingJob(
                job_id=f"j{len(jobs):06d}", tenant=tenant.name, tier=tenant.tier, priority=priority,
                prompt_tokens=prompt, max_new_tokens=max_new, enqueued_at=t, deadline=t + w.timeout(priority),
                partition=partition[tenant.name]))
            t += rng.expovariate(rate)
    return jobs


@dataclass
class JobRecord:
    job: PendingJob
    outcome: str = "waiting"  # done | expired | rejected | shed | waiting (never decided)
    admitted_at: Optional[float] = None
    finished_at: Optional[float] = None  # done: finished (None while running); otherwise when it left

    @property
    def wait(self) -> Optional[float]:
        return None if self.admitted_at is None else self.admitted_at - self.job.enqueued_at

    @property
    def e2e(self) -> Optional[float]:
        return None if self.outcome != "done" or self.finished_at is None else self.finished_at - self.job.enqueued_at

    @property
    def in_time(self) -> bool:
        """Finished before its deadline: its tokens count as goodput."""
        return (self.outcome == "done" and self.finished_at is not None
                and (self.job.deadline is None or self.finished_at <= self.job.deadline))


@dataclass
class SimResult:
    policy: str
    records: list[JobRecord]
    #: (t, jobs waiting in topics and buffer, tokens in use) once per virtual second.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


class _Worker:
    """One continuous batch on a virtual clock. Steps are counted, not enumerated: while
    the batch does not change, every job on it gains one token per a + b·n seconds, so a
    job joining at step S with m tokens to generate leaves at step S + m. A joining
    prompt adds b·prompt_tokens to the next step (`stall_s`), for every job on it."""

    def __init__(self, service: BatchService) -> None:
        self.service = service
        self.clock = 0.0
        self.steps = 0.0  # decode steps done since the start (fractional between events)
        self.stall_s = 0.0  # prefill time still to pay before decoding goes on
        self.reserved = 0  # tokens of the jobs on it: placement's load measure
        self.running: list[tuple[float, int, PendingJob]] = []  # heap by the step it finishes at
        self.queued: deque[tuple[PendingJob, int]] = deque()  # past max_seqs: wait for a thread, FIFO

    @property
    def jobs(self) -> int:
        return len(self.running) + len(self.queued)

    def join(self, job: PendingJob, seq: int) -> None:
        self.reserved += job.cost
        if self.service.max_seqs and len(self.running) >= self.service.max_seqs:
            self.queued.append((job, seq))
            return
        self._run(job, seq)

    def _run(self, job: PendingJob, seq: int) -> None:
        self.stall_s += self.service.b_s_per_token * job.prompt_tokens
        heapq.heappush(self.running, (self.steps + job.max_new_tokens, seq, job))

    def advance(self, to: float) -> list[tuple[PendingJob, float]]:
        """Run the batch until `to`; the jobs that finished, with when."""
        finished: list[tuple[PendingJob, float]] = []
        while self.clock < to and self.running:
            if self.stall_s > 0:
                paid = min(self.stall_s, to - self.clock)
                self.clock += paid
                self.stall_s -= paid
                continue
            step_s = self.service.step_s(len(self.running))  # one decode token per job
            at = self.clock + (self.running[0][0] - self.steps) * step_s
            if at > to:
                self.steps += (to - self.clock) / step_s
                break
            self.clock, self.steps = at, self.running[0][0]
            while self.running and self.running[0][0] <= self.steps:
                job = heapq.heappop(self.running)[2]
                self.reserved -= job.cost
                finished.append((job, at))
            while self.queued and len(self.running) < self.service.max_seqs:
                self._run(*self.queued.popleft())  # a thread came free
        self.clock = max(self.clock, to)
        if not self.running:
            self.stall_s = 0.0
        return finished


class _Fleet:
    """The token budget and the jobs running on it, under either service model."""

    def __init__(self, capacity: int, service: ServiceModel | BatchService) -> None:
        self.capacity = capacity
        self.service = service
        self.in_use = 0
        self.by_tenant: dict[str, int] = {}
        self.by_class: dict[Priority, int] = {}
        self.fixed: list[tuple[float, int, PendingJob]] = []  # ServiceModel: heap by finish time
        self.workers = [_Worker(service) for _ in range(service.workers)] if isinstance(service, BatchService) else []
        self._seq = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.fixed) or any(w.running for w in self.workers)

    def start(self, job: PendingJob, now: float) -> Optional[float]:
        """Start `job` now; its finish time if the service model knows it already."""
        self._add(job, job.cost)
        if not self.workers:
            finish = now + self.service.seconds(job.prompt_tokens, job.max_new_tokens)
            heapq.heappush(self.fixed, (finish, next(self._seq), job))
            return finish
        min(self.workers, key=lambda w: w.reserved).join(job, next(self._seq))
        return None

    def finish_until(self, now: float) -> list[tuple[PendingJob, float]]:
        """Release the jobs finished by `now`; each with its finish time."""
        finished = []
        while self.fixed and self.fixed[0][0] <= now:
            finish, _, job = heapq.heappop(self.fixed)
            finished.append((job, finish))
        for w in self.workers:
            finished.extend(w.advance(now))
        for job, _ in finished:
            self._add(job, -job.cost)
        return finished

    def _add(self, job: PendingJob, tokens: int) -> None:
        self.in_use += tokens
        self.by_tenant[job.tenant] = self.by_tenant.get(job.tenant, 0) + tokens
        self.by_class[job.priority] = self.by_class.get(job.priority, 0) + tokens

    def budget(self) -> Budget:
        # Slots as the workers' heartbeats report them (kvfleet/capacity.py): the policy
        # admits into free threads; FIFO and strict priority do not look (their `_admit`).
        slots = self.service.max_seqs * self.service.workers if isinstance(self.service, BatchService) else 0
        jobs = sum(w.jobs for w in self.workers) if slots else 0
        return Budget(self.capacity, self.in_use, dict(self.by_tenant), dict(self.by_class), slots=slots, jobs=jobs)


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


def simulate(policy: Policy, jobs: list[PendingJob], *, capacity: int, service: ServiceModel | BatchService,
             tick_s: float = 0.05, horizon_s: float = 3600.0) -> SimResult:
    """Run until every job is decided and finished (or `horizon_s` after the last arrival)."""
    arrivals = sorted(jobs, key=lambda j: (j.enqueued_at, j.job_id))
    records = {j.job_id: JobRecord(j) for j in arrivals}
    fleet, topics = _Fleet(capacity, service), _Topics()
    result = SimResult(policy.name, list(records.values()))
    end = (arrivals[-1].enqueued_at if arrivals else 0.0) + horizon_s
    next_sample, i, step = 0.0, 0, 0
    while (i < len(arrivals) or len(topics) or policy.pending() or fleet.busy) and step * tick_s <= end:
        now = step * tick_s  # a multiple, not a running sum: no drift in the clock
        for job, finished_at in fleet.finish_until(now):
            records[job.job_id].finished_at = finished_at
        while i < len(arrivals) and arrivals[i].enqueued_at <= now:
            topics.produce(arrivals[i])
            i += 1
        for p in Priority:
            for job in topics.poll(p, policy.config.max_buffered - policy.pending(p), policy.paused):
                policy.add(job)
        decision = policy.schedule(now, fleet.budget())
        for job in decision.admit:
            records[job.job_id].admitted_at, records[job.job_id].finished_at = now, fleet.start(job, now)
            records[job.job_id].outcome = "done"
        for outcome, verdicts in (("expired", decision.expire), ("rejected", decision.reject), ("shed", decision.shed)):
            for v in verdicts:
                records[v.job.job_id].outcome, records[v.job.job_id].finished_at = outcome, now
        if now >= next_sample:
            result.timeline.append((now, len(topics) + policy.pending(), fleet.in_use))
            next_sample += 1.0
        step += 1
        if not (len(topics) or policy.pending() or fleet.busy) and i < len(arrivals):
            step = max(step, math.ceil(arrivals[i].enqueued_at / tick_s))  # idle: skip ahead
    return result
