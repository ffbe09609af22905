"""Replays a workload through an admission policy with a virtual clock.

The fleet is its token budget: a job holds `cost` tokens from admission until it
finishes. How long it runs is the service model's:
- `BatchService` (the benchmark's): each worker runs its engine's continuous batch,
  step by step as workers/engine/scheduler.py builds them: one token for every
  decoding job, a chunk of every prompt still prefilling, within the step's token
  budget, the prompts' chunks within the decode-step slack while jobs decode, and the
  priority guard's allowance for the classes below the best one present. A step of n
  tokens takes t(n) = a + b·n seconds (the engine's own step-cost model,
  workers/engine/step_cost.py). So a job's time grows with the batch it shares: every
  co-running job adds b to each of its steps, and every prompt that joins its worker
  adds b·prompt_tokens to its steps, spread over as many as the slack asks, unless the
  guard holds that work back.
- `ServiceModel`: a fixed time per job (a floor plus time per prompt and per generated
  token), whatever else runs; the policy tests use it for exact timings.
Each priority topic has one partition per tenant (Kafka keys by tenant), read
round-robin into the policy's buffer unless the policy paused it. Every `tick_s` the
loop does what the service does around a poll: finish jobs, poll, `schedule()`, start
the admitted.

Deterministic: the same `Workload` (seed included) gives the same jobs and results.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvfleet.contracts import Priority
from kvfleet.settings import EngineConfig
from kvfleet.tenancy import Tier
from scheduler.policy import Budget, Partition, PendingJob, Policy

_ENGINE = EngineConfig()  # the engine's defaults, which the batch model follows


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
    """Workers running their engine's continuous batch, a step taking a + b·n_tokens.

    What the engine does with a step (workers/engine/scheduler.py) is modelled: prompts
    are prefilled in chunks of the step's `max_num_batched_tokens`, decoding sequences
    take one token a step, while any decodes the prompts' chunks together take the
    tokens that keep the step within `decode_step_slack` of the decodes alone (at least
    one; a prompt with no decode ahead of it in service order is not held to it), and
    the priority guard holds lower classes back while a
    better class is in the engine: they share an allowance of the tokens that keep the
    step within `priority_step_slack` of the best class's work alone (at least one a
    step). Not modelled: preemption (the engine's block pool is never short here: the
    ledger's budget keeps a worker's jobs within its KV), the prefix cache, and the
    StepCost fit's warm-up (the guard and the slack use the true a and b from the first step).
    Admitted jobs wait in one Celery queue, high first, for a free thread of any worker."""

    #: Defaults: builtin:bench on one CPU thread, from bench/results/engine.json's
    #: uncontended runs (step = concurrency / tokens_per_s at 1, 8, 32 and 64
    #: concurrent: 3.8, 9.7, 27.7, 53 ms): a ≈ 3 ms, b ≈ 0.78 ms per token.
    #: `python -m bench.sim.step_cost_probe` measures them again.
    a_s: float = 0.003
    b_s_per_token: float = 0.00078
    workers: int = 4
    #: Jobs a worker runs at once: its Celery threads (below the engine's max_num_seqs,
    #: so the engine never queues). 0: no limit.
    max_seqs: int = 0
    #: The engine's knobs, at their defaults (kvfleet/settings.py EngineConfig).
    priority_step_slack: float = _ENGINE.priority_step_slack
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    decode_step_slack: float = _ENGINE.decode_step_slack

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


class _Seq:
    """One job in a worker's engine: its prompt still to prefill, its tokens still to sample."""

    __slots__ = ("job", "key", "prompt_left", "gen_left")

    def __init__(self, job: PendingJob, order: int) -> None:
        self.job = job
        self.key = (job.priority.rank, order)  # the engine's Sequence.sort_key: class, then arrival
        self.prompt_left = job.prompt_tokens
        self.gen_left = job.max_new_tokens

    @property
    def wanted(self) -> int:
        """Tokens it would compute in a step: the rest of its prompt, or one decode token."""
        return self.prompt_left or 1

    def compute(self, steps: int, tokens: int) -> None:
        """`steps` steps of `tokens` each; the step that ends the prompt samples the first token."""
        if self.prompt_left:
            self.prompt_left -= steps * tokens
            if not self.prompt_left:
                self.gen_left -= 1
        else:
            self.gen_left -= steps


class _Worker:
    """One engine on a virtual clock, step by step as workers/engine/scheduler.py builds
    them (`grants`), but counted, not enumerated: while no sequence changes phase (its
    prompt done, its last token), every step grants the same tokens to the same
    sequences, so `advance` jumps over such runs of steps at once."""

    def __init__(self, service: BatchService) -> None:
        self.service = service
        self.clock = 0.0
        self.reserved = 0  # tokens of the jobs on it: placement's load measure
        self.running: list[_Seq] = []  # in service order (sort key)
        self.finished: list[tuple[PendingJob, float]] = []  # computed to the end after the last `advance(to)`
        self._order = itertools.count()

    @property
    def jobs(self) -> int:
        """Task threads taken: running, or finished after the moment the fleet has reached."""
        return len(self.running) + len(self.finished)

    @property
    def free_threads(self) -> bool:
        return not self.service.max_seqs or self.jobs < self.service.max_seqs

    def join(self, job: PendingJob) -> None:
        self.reserved += job.cost
        bisect.insort(self.running, _Seq(job, next(self._order)), key=lambda s: s.key)

    def grants(self) -> list[int]:
        """Tokens each running sequence computes in the next step (0: held back).

        The engine's `Scheduler.schedule`: the best class present sets the pace and is
        served first; then, while it is there, the lower classes share an allowance of
        the tokens that keep the step within `priority_step_slack` of the best class's
        work alone (StepCost.extra_tokens, with the service's a and b as the fit), at
        least one, handed out in service order; the chunks of prompts with a decode ahead of
        them within the stall-free bound (`_prefill_bound`); everything within the step's
        `max_num_batched_tokens` (a long prompt is prefilled in chunks)."""
        s = self.service
        top = self.running[0].key[0]
        budget = s.max_num_batched_tokens
        prefilled = 0  # prefill tokens granted so far: they count against each next limit
        decode_ahead = False  # a decoding sequence ahead in service order
        bound = self._prefill_bound()
        grants = []
        allowance: Optional[int] = None
        for seq in self.running:
            if allowance is None and seq.key[0] > top and not math.isinf(s.priority_step_slack):
                alone = max(s.step_s(s.max_num_batched_tokens - budget), s.b_s_per_token)
                allowance = max(1, int(s.priority_step_slack * alone / s.b_s_per_token))
            n = min(seq.wanted, budget)
            if seq.prompt_left:
                n = min(n, max((bound if decode_ahead else s.max_num_batched_tokens) - prefilled, 0))
            if allowance is not None:
                n = min(n, allowance)
                allowance -= n
            if seq.prompt_left:
                prefilled += n
            else:
                decode_ahead = True
            budget -= n
            grants.append(n)
        return grants

    def _prefill_bound(self) -> int:
        """The engine's stall-free decodes: while sequences decode, the prompts' chunks
        together take the tokens that keep the step within `decode_step_slack` of the
        decodes alone (StepCost.extra_tokens), at least one; but only the prompts with a
        decode ahead of them in service order are held to it (`grants`)."""
        s = self.service
        decoding = sum(not seq.prompt_left for seq in self.running)
        if not decoding or math.isinf(s.decode_step_slack) or s.b_s_per_token <= 0:
            return s.max_num_batched_tokens
        extra = max(1, int(s.decode_step_slack * s.step_s(decoding) / s.b_s_per_token))
        return min(extra, s.max_num_batched_tokens)

    def advance(self, to: float) -> list[tuple[PendingJob, float]]:
        """Run the engine's steps that start before `to`; the jobs finished by `to`, with when."""
        while self.running and self.clock < to:
            grants = self.grants()
            step_s = self.service.step_s(sum(grants))
            # Steps with these same grants: until a sequence ends its prompt or its
            # output (a chunk that takes a prompt's rest changes the next step's grant).
            k = min((seq.prompt_left or seq.gen_left) // n for seq, n in zip(self.running, grants) if n)
            k = min(k, math.ceil((to - self.clock) / step_s))
            self.clock += k * step_s
            for seq, n in zip(list(self.running), grants):
                if n:
                    seq.compute(k, n)
                    if not seq.gen_left:
                        self.running.remove(seq)
                        self.reserved -= seq.job.cost
                        self.finished.append((seq.job, self.clock))
        self.clock = max(self.clock, to)
        done = [(job, at) for job, at in self.finished if at <= to]
        self.finished = [(job, at) for job, at in self.finished if at > to]
        return done


class _Fleet:
    """The token budget and the jobs running on it, under either service model."""

    def __init__(self, capacity: int, service: ServiceModel | BatchService) -> None:
        self.capacity = capacity
        self.service = service
        self.in_use = 0
        self.by_tenant: dict[str, int] = {}
        self.by_class: dict[Priority, int] = {}
        self.by_tenant_class: dict[tuple[str, Priority], int] = {}
        self.fixed: list[tuple[float, int, PendingJob]] = []  # ServiceModel: heap by finish time
        self.workers = [_Worker(service) for _ in range(service.workers)] if isinstance(service, BatchService) else []
        #: Admitted tasks no thread has taken yet: the Celery queues, read high first and
        #: FIFO within a class by whichever worker's thread is free (kvfleet/celery_app.py:
        #: queue_order_strategy "priority", prefetch 1 per thread).
        self.celery: list[tuple[int, int, PendingJob]] = []
        self._seq = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.fixed) or bool(self.celery) or any(w.jobs for w in self.workers)

    def start(self, job: PendingJob, now: float) -> Optional[float]:
        """Start `job` now; its finish time if the service model knows it already."""
        self._add(job, job.cost)
        if not self.workers:
            finish = now + self.service.seconds(job.prompt_tokens, job.max_new_tokens)
            heapq.heappush(self.fixed, (finish, next(self._seq), job))
            return finish
        heapq.heappush(self.celery, (job.priority.rank, next(self._seq), job))
        self._hand_out()
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
        self._hand_out()  # threads freed by now take queued tasks (at the tick, not at the finish)
        return finished

    def _hand_out(self) -> None:
        """Queued tasks to free threads, best first; among workers with a free thread,
        the one with the fewest reserved tokens."""
        while self.celery:
            free = [w for w in self.workers if w.free_threads]
            if not free:
                return
            min(free, key=lambda w: w.reserved).join(heapq.heappop(self.celery)[2])

    def _add(self, job: PendingJob, tokens: int) -> None:
        self.in_use += tokens
        self.by_tenant[job.tenant] = self.by_tenant.get(job.tenant, 0) + tokens
        self.by_class[job.priority] = self.by_class.get(job.priority, 0) + tokens
        key = (job.tenant, job.priority)
        self.by_tenant_class[key] = self.by_tenant_class.get(key, 0) + tokens

    def budget(self) -> Budget:
        # Slots as the workers' heartbeats report them (kvfleet/capacity.py): the policy
        # admits into free threads; FIFO and strict priority do not look (their `_admit`).
        slots = self.service.max_seqs * self.service.workers if isinstance(self.service, BatchService) else 0
        jobs = sum(w.jobs for w in self.workers) + len(self.celery) if slots else 0
        return Budget(self.capacity, self.in_use, dict(self.by_tenant), dict(self.by_class), slots=slots, jobs=jobs,
                      tenant_class_in_use=dict(self.by_tenant_class))


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
