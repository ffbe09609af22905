"""Admission policy: which buffered jobs get the fleet's free KV tokens now.

Pure: no I/O and no clock. The service feeds it the jobs it polled (`add`) and calls
`schedule(now, budget)` with the ledger's view of the budget after every poll; the
benchmark's simulator (bench/sim/) drives the same object with a virtual clock.

What one `schedule()` call does, in order:
1. Ceilings. A job over its class's token ceiling (high 2×base, normal base, low
   base/4; kvfleet/ceiling.py, the API's check too) can never run; `add()` already set
   it aside and it is returned as rejected.
2. Deadlines. A job whose deadline has passed is expired.
3. Order. Every buffered job gets a level:
     0: waited past its class's `max_wait_s`: goes first (the hard aging bound),
     1: its class is under its guaranteed `share` of the budget: classes in rank
        order (high first), so each class keeps its share under contention,
     2: borrowing (its class is over its share): by aged priority,
        rank - wait / aging_s, so a lower class overtakes fresh higher ones in time.
   Work-conserving: a share nobody uses is lent (level 2) instead of held idle.
4. Fit. A job is admitted if it fits in the free budget, where the unused part of
   every gold tenant's reserve is room for that tenant only, and its tenant is within
   its share (silver: burst cap, bronze: its limit) and under its hard `limit` if it
   has one.
   Borrowing (`borrow_idle`): a job that would take its tenant over its share (but not
   over a hard `limit`) is set aside and considered after every other job of the call,
   for what they left: capacity nobody within a share is waiting for. It never holds
   the budget, and nothing is borrowed while it is held, so borrowed work is the first
   to give way: the tokens and slots it frees go to jobs within their shares first.
   Slots: a job needs a free task slot too, and normal and low jobs leave the last
   `high_slot_reserve` of them to high jobs, so a burst of high work finds threads.
5. Hold. The first job blocked by the budget that has waited its class's
   `reserve_after_s` holds the line: nothing after it takes the shared budget in this
   call, so the tokens that free up accumulate for it and a stream of small jobs
   cannot keep taking them (TGI forces waiting requests in after `max_waiting_tokens`
   steps for the same reason). Jobs that are merely blocked are skipped, so smaller
   jobs behind them backfill.
6. Shedding (bronze only; other tiers only ever expire on their deadline). With
   `bronze_shed_late`, a bronze job is shed once it can no longer be admitted before
   its deadline: the tokens buffered ahead of it, at the rate the buffer has been
   draining (scheduler/drain_rate.py), reach past it. So shedding refuses only work that
   would expire anyway, while its client can still retry in time. With
   `bronze_shed_after_s` set, a bronze job that waited that long is shed as well.
7. Backpressure, per Kafka partition (partitions are keyed by tenant). While the
   budget is spent nothing leaves the buffer, so it fills: a class with `max_buffered`
   jobs pauses every partition it holds a job from, and resumes them as admissions
   (or expiries, sheds) bring it under. A partition with nothing buffered is never
   paused, so each one's next job stays visible and a tenant stuck at its tier limit
   blocks only its own partition, never the class.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, Optional

from kvfleet.ceiling import over_ceiling
from kvfleet.contracts import JobRequest, Priority, token_cost
from kvfleet.settings import PolicyConfig
from kvfleet.tenancy import Tenant, Tier
from scheduler.drain_rate import DrainRate


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    tenant: str
    tier: Tier
    priority: Priority
    prompt_tokens: int
    max_new_tokens: int
    enqueued_at: float  # unix (or virtual) seconds: the job's submitted_at
    deadline: Optional[float] = None
    partition: int = 0  # Kafka partition of its class topic: the unit of pause/resume

    @property
    def cost(self) -> int:
        """KV tokens the job can hold at its peak: what the ledger reserves."""
        return token_cost(self.prompt_tokens, self.max_new_tokens)

    @classmethod
    def from_request(cls, request: JobRequest, *, tier: Tier, partition: int) -> "PendingJob":
        """From a tokenized request (its `prompt_tokens` set)."""
        if request.prompt_tokens is None:
            raise ValueError(f"job {request.job_id!r} has a text prompt: tokenize it first")
        return cls(request.job_id, request.tenant, tier, request.priority, len(request.prompt_tokens),
                   request.max_new_tokens, request.submitted_at, request.deadline, partition)


@dataclass(frozen=True)
class Budget:
    """The fleet's token budget as the ledger sees it now."""

    capacity: int
    in_use: int
    tenant_in_use: Mapping[str, int] = field(default_factory=dict)
    class_in_use: Mapping[Priority, int] = field(default_factory=dict)
    #: Jobs the live workers run at once (0 = no limit), and jobs reserved now: a job
    #: is admitted only into a free slot as well as into free tokens.
    slots: int = 0
    jobs: int = 0
    #: Tokens by (tenant, class): a tenant's share is filled by its best classes first.
    #: Left empty (with `tenant_in_use` set), every class of a tenant counts its total.
    tenant_class_in_use: Mapping[tuple[str, Priority], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """A job leaving the buffer without running, and why."""

    job: PendingJob
    code: str  # "too_many_tokens" | "deadline_passed" | "overloaded"
    message: str


#: (class, partition number): one partition of one priority topic.
Partition = tuple[Priority, int]


@dataclass(frozen=True)
class Decision:
    admit: tuple[PendingJob, ...] = ()  # in admission order: reserve them in this order
    expire: tuple[Verdict, ...] = ()
    reject: tuple[Verdict, ...] = ()
    shed: tuple[Verdict, ...] = ()
    #: The job the budget is being held for, if any (the `holding` gauge shows its class).
    holding: Optional[PendingJob] = None


class Room:
    """The budget during one `schedule()` call: a shared pool plus, per gold tenant,
    the unused part of its reserve, which only that tenant may take."""

    def __init__(self, budget: Budget, reserves: Mapping[str, int], *, high_slots: int = 0) -> None:
        self.capacity = budget.capacity
        self.tenant_in_use = dict(budget.tenant_in_use)
        self.class_in_use = dict(budget.class_in_use)
        self.tenant_class_in_use = dict(budget.tenant_class_in_use)
        self._by_class_known = bool(budget.tenant_class_in_use) or not budget.tenant_in_use
        self.unused_reserve = {t: max(0, r - self.tenant_in_use.get(t, 0)) for t, r in reserves.items()}
        # Negative when in use exceeds the capacity (a worker just died): nothing fits.
        self.shared = budget.capacity - budget.in_use - sum(self.unused_reserve.values())
        self.free_slots: Optional[int] = budget.slots - budget.jobs if budget.slots > 0 else None
        self.high_slots = high_slots  # the last free slots, which only high jobs take

    @property
    def slots_left(self) -> bool:
        return self.free_slots is None or self.free_slots > 0

    def slot_for(self, job: "PendingJob") -> bool:
        """Is a slot free for this job? Normal and low leave the last `high_slots` to high."""
        if self.free_slots is None:
            return True
        return self.free_slots > (0 if job.priority is Priority.HIGH else self.high_slots)

    def tenant_ahead(self, job: "PendingJob") -> int:
        """Tokens the job's tenant holds in its class and the better ones: what fills its
        share before this job (its lower classes' work is borrowing, or yields to it)."""
        if not self._by_class_known:
            return self.tenant_in_use.get(job.tenant, 0)
        return sum(self.tenant_class_in_use.get((job.tenant, p), 0) for p in Priority
                   if p.rank <= job.priority.rank)

    def free_for(self, tenant: str, *, shared: bool = True) -> int:
        return self.unused_reserve.get(tenant, 0) + (max(0, self.shared) if shared else 0)

    def take(self, job: PendingJob) -> None:
        from_reserve = min(job.cost, self.unused_reserve.get(job.tenant, 0))
        if from_reserve:
            self.unused_reserve[job.tenant] -= from_reserve
        self.shared -= job.cost - from_reserve
        if self.free_slots is not None:
            self.free_slots -= 1
        self.tenant_in_use[job.tenant] = self.tenant_in_use.get(job.tenant, 0) + job.cost
        self.class_in_use[job.priority] = self.class_in_use.get(job.priority, 0) + job.cost
        key = (job.tenant, job.priority)
        self.tenant_class_in_use[key] = self.tenant_class_in_use.get(key, 0) + job.cost


class Policy:
    """kvfleet's admission policy. Subclasses (the benchmark's baselines) replace `_admit`
    and `_shed`; buffering, ceilings, deadlines and backpressure are shared."""

    name = "kvfleet"

    def __init__(self, config: PolicyConfig = PolicyConfig(), tenants: Mapping[str, Tenant] | None = None) -> None:
        self.config = config
        self.tenants: Mapping[str, Tenant] = tenants or {}
        self._buffer: dict[Priority, list[PendingJob]] = {p: [] for p in Priority}
        self._rejected: list[Verdict] = []
        self._paused: frozenset[Partition] = frozenset()
        self._drain = DrainRate()  # how fast the buffer empties while jobs wait: bronze_shed_late's rate

    # --- the interface the service and the simulator drive ---

    def add(self, job: PendingJob) -> None:
        """Buffer a polled job (a job over its ceiling is set aside as rejected)."""
        too_many = over_ceiling(job.priority, job.prompt_tokens, job.max_new_tokens, self.config)
        if too_many is not None:
            self._rejected.append(Verdict(job, "too_many_tokens", too_many))
        else:
            self._buffer[job.priority].append(job)

    def requeue(self, job: PendingJob) -> None:
        """Give back an admitted job whose ledger reservation lost a race to another
        replica; it keeps its place (its enqueue time is unchanged)."""
        self._buffer[job.priority].append(job)

    def forget(self, partitions: set[Partition]) -> list[PendingJob]:
        """Drop and return the buffered jobs read from `partitions` (revoked from this
        replica: their new owner reads them again from the committed offsets)."""
        gone = [v.job for v in self._rejected if (v.job.priority, v.job.partition) in partitions]
        self._rejected = [v for v in self._rejected if (v.job.priority, v.job.partition) not in partitions]
        return gone + self._take(lambda j: (j.priority, j.partition) in partitions)

    def schedule(self, now: float, budget: Budget) -> Decision:
        """Decide what leaves the buffer now; the admitted are removed, in admission order."""
        rejected, self._rejected = tuple(self._rejected), []
        expired = self._take(lambda j: j.deadline is not None and j.deadline <= now)
        room = Room(budget, self._reserves(budget.capacity),
                    high_slots=int(self.config.high_slot_reserve * budget.slots))
        admitted, holding = self._admit(now, room)
        ids = {j.job_id for j in admitted}
        self._take(lambda j: j.job_id in ids)
        self._drain.record(now, sum(j.cost for j in admitted), waiting=self.pending() > 0)
        shed = self._shed(now, room)
        self._backpressure()
        return Decision(
            admit=tuple(admitted),
            expire=tuple(Verdict(j, "deadline_passed", f"deadline passed {now - j.deadline:.1f} s before admission")
                         for j in expired),
            reject=rejected,
            shed=shed,
            holding=holding,
        )

    def pending(self, priority: Optional[Priority] = None) -> int:
        if priority is not None:
            return len(self._buffer[priority])
        return sum(len(b) for b in self._buffer.values())

    @property
    def paused(self) -> frozenset[Partition]:
        return self._paused

    # --- kvfleet's rules ---

    def _admit(self, now: float, room: Room) -> tuple[list[PendingJob], Optional[PendingJob]]:
        queues = {p: sorted(b, key=_fifo) for p, b in self._buffer.items()}
        heads = {p: 0 for p in Priority}
        admitted: list[PendingJob] = []
        holding: Optional[PendingJob] = None
        held_tenants: set[str] = set()  # their own limit is being held for one of their jobs
        borrowers: list[PendingJob] = []  # over their tenant's share: last, from what is left
        while room.slots_left:  # every worker thread taken: the rest waits for one
            candidates = [(self._rank(q[heads[p]], now, room), p) for p, q in queues.items() if heads[p] < len(q)]
            if not candidates:
                break
            _, p = min(candidates)
            job = queues[p][heads[p]]
            heads[p] += 1
            due = now - job.enqueued_at >= self.config.of(p).reserve_after_s
            if job.tenant in held_tenants or not room.slot_for(job):
                continue
            if not self._within_hard_cap(job, room):
                # Over its hard limit: it waits without blocking other tenants, and once
                # due, the tenant's own smaller jobs stop taking the room it needs.
                if due and job.cost <= self._hard_cap(job) * room.capacity:
                    held_tenants.add(job.tenant)
                continue
            if room.tenant_ahead(job) + job.cost > self._tenant_cap(job) * room.capacity:
                borrowers.append(job)  # over its share, within its hard limit
                continue
            if job.cost <= room.free_for(job.tenant, shared=holding is None):
                room.take(job)
                admitted.append(job)
            elif holding is None and due and self._could_fit(job, room):
                holding = job  # from here on only gold tenants' own reserves are taken
        if holding is None:  # a held budget is lent to no one: it accumulates for the held job
            for job in borrowers:
                if not room.slots_left:
                    break
                if room.slot_for(job) and job.cost <= room.free_for(job.tenant) and self._within_hard_cap(job, room):
                    room.take(job)
                    admitted.append(job)
        return admitted, holding

    def _rank(self, job: PendingJob, now: float, room: Room) -> tuple:
        """Sort key of a class's head: lower goes first (levels as in the module docstring)."""
        c = self.config.of(job.priority)
        wait = now - job.enqueued_at
        if wait >= c.max_wait_s:
            return (0, job.enqueued_at, job.job_id)
        if room.class_in_use.get(job.priority, 0) + job.cost <= c.share * room.capacity:
            return (1, job.priority.rank, job.enqueued_at, job.job_id)
        return (2, job.priority.rank - wait / self.config.aging_s, job.enqueued_at, job.job_id)

    def _within_hard_cap(self, job: PendingJob, room: Room) -> bool:
        return room.tenant_in_use.get(job.tenant, 0) + job.cost <= self._hard_cap(job) * room.capacity

    def _tenant_cap(self, job: PendingJob) -> float:
        """Most of the budget the job's tenant may hold while others wait, as a fraction:
        gold has no cap beyond the budget (its reserve is a floor), silver its burst,
        bronze its limit; at most its hard cap."""
        share = 1.0 if job.tier is Tier.GOLD else self._share(job.tenant, job.tier)
        return min(share, self._hard_cap(job))

    def _hard_cap(self, job: PendingJob) -> float:
        """Most of the budget the job's tenant may ever hold: its own `limit`; without
        one the whole budget, or its share when shares are not lent (`borrow_idle` off)."""
        known = self.tenants.get(job.tenant)
        if known is not None and known.limit is not None:
            return known.limit
        if self.config.borrow_idle or job.tier is Tier.GOLD:
            return 1.0
        return self._share(job.tenant, job.tier)

    def _could_fit(self, job: PendingJob, room: Room) -> bool:
        """Holding the budget for a job that could never fit would stall the fleet."""
        others_reserved = sum(r for t, r in self._reserves(room.capacity).items() if t != job.tenant)
        return job.cost <= room.capacity - others_reserved

    def _shed(self, now: float, room: Room) -> tuple[Verdict, ...]:
        limit = self.config.bronze_shed_after_s
        waited = self._take(lambda j: j.tier is Tier.BRONZE and limit is not None and now - j.enqueued_at >= limit)
        verdicts = [Verdict(j, "overloaded", f"fleet overloaded: bronze job shed after waiting "
                            f"{now - j.enqueued_at:.1f} s; retry later") for j in waited]
        rate = self._drain.tokens_per_s() if self.config.bronze_shed_late else None
        if rate is not None:
            late = self._late_bronze(now, room, rate)
            self._take(lambda j: j.job_id in late)
            verdicts += [Verdict(j, "overloaded", f"fleet overloaded: {ahead} tokens wait ahead of this bronze job, "
                                 f"{ahead / rate:.0f} s at the {rate:.0f} tokens/s the fleet drains; it would start "
                                 f"after its deadline. Retry later") for j, ahead in late.values()]
        return tuple(verdicts)

    def _late_bronze(self, now: float, room: Room, rate: float) -> dict[str, tuple[PendingJob, int]]:
        """Bronze jobs that cannot be admitted before their deadline, each with the tokens
        ahead of it: the buffered jobs that go first (jobs within their tenant's share
        before borrowers; among each, those past their class's aging bound, oldest first,
        then better classes, then older jobs of the same class) and itself, less what is
        free for it now, drained at `rate` tokens per second.

        The count leaves out what makes the wait longer still (jobs that will arrive
        with a better rank, or within their share while this one borrows), so a job is
        shed only when even this short wait passes its deadline."""
        def order(job: PendingJob) -> tuple:
            borrowing = room.tenant_ahead(job) + job.cost > self._tenant_cap(job) * room.capacity
            if now - job.enqueued_at >= self.config.of(job.priority).max_wait_s:
                return (borrowing, 0, 0, job.enqueued_at, job.job_id)
            return (borrowing, 1, job.priority.rank, job.enqueued_at, job.job_id)

        buffered = [j for b in self._buffer.values() for j in b]
        if not any(j.tier is Tier.BRONZE and j.deadline is not None for j in buffered):
            return {}  # the common case: nothing to shed, so no sort on every call
        queue = sorted(buffered, key=order)
        late: dict[str, tuple[PendingJob, int]] = {}
        for job, before in zip(queue, itertools.accumulate((j.cost for j in queue), initial=0)):
            if job.tier is not Tier.BRONZE or job.deadline is None:
                continue
            ahead = max(0, before + job.cost - room.free_for(job.tenant))
            if now + ahead / rate > job.deadline:
                late[job.job_id] = (job, ahead)
        return late

    def _share(self, tenant: str, tier: Tier) -> float:
        known = self.tenants.get(tenant)
        if known is not None and known.share is not None:
            return known.share
        return {Tier.GOLD: self.config.gold_reserve, Tier.SILVER: self.config.silver_burst,
                Tier.BRONZE: self.config.bronze_limit}[tier]

    def _reserves(self, capacity: int) -> dict[str, int]:
        return {t.name: int(self._share(t.name, Tier.GOLD) * capacity)
                for t in self.tenants.values() if t.tier is Tier.GOLD}

    # --- shared bookkeeping ---

    def _take(self, predicate) -> list[PendingJob]:
        """Remove and return the buffered jobs matching `predicate`."""
        taken: list[PendingJob] = []
        for p, jobs in self._buffer.items():
            keep = []
            for job in jobs:
                (taken if predicate(job) else keep).append(job)
            self._buffer[p] = keep
        return taken

    def _backpressure(self) -> None:
        """The partitions to keep paused (`paused`): every one a full class holds a job from."""
        full = {p for p, b in self._buffer.items() if len(b) >= self.config.max_buffered}
        self._paused = frozenset((j.priority, j.partition) for p in full for j in self._buffer[p])


def _fifo(job: PendingJob) -> tuple[float, str]:
    return (job.enqueued_at, job.job_id)
