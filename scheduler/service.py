"""`kvfleet-scheduler`: reads the priority topics, admits jobs into the fleet's KV token
budget, and hands them to the workers.

One loop iteration, top to bottom (each step is a method below):
  poll      records of every partition not paused
  intake    decode each record (or dead-letter it); then by the job's state: buffer it
            in the policy (queued), send it again (admitted: a crash or rebalance fell
            between admission and commit), or skip it (running, finished, cancelled)
  reclaim   reservations whose lease ran out (their worker died): send those jobs again
  schedule  the policy (scheduler/policy.py) decides on the budget: live capacity from
            the workers' heartbeats, tokens in use from the ledger
  dispatch  reserve + admit + send the jobs to send again, then the policy's choice
  refuse    expire, reject and shed what the policy turned away
  pause     pause / resume partitions as the policy's buffer fills and drains
  commit    per partition, up to its oldest record still undecided

Beside the loop, in its own thread, the results relay (kvfleet/results.py) produces every
terminal result to Kafka from the job store's outbox; the loop checks that it lives.

Nothing is lost and nothing runs twice: an offset is committed only once its job is
durably admitted, refused or dead-lettered (`OffsetBook`); a job is admitted with its
reservation in one atomic step that refuses any job not queued (or admitted: a re-send
that counts nothing twice), so a restarted replica or a rebalance may read a job again
but never reserves or runs it twice. Memory stays bounded: the policy pauses a class's
partitions once it buffers `max_buffered` jobs, so at most 3 × max_buffered + one poll
(`max_poll_records`) jobs are held; the rest waits in Kafka.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import kombu.exceptions
import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import CommitFailedError, KafkaError

from kvfleet import heap, logs
from kvfleet.capacity import FleetCapacity
from kvfleet.celery_app import make_celery
from kvfleet.contracts import JobRequest, JobState, Priority
from kvfleet.jobstore import JobStore
from kvfleet.kafka import (DeliveryFailed, deliver, ensure_topics, make_admin, make_batch_producer, make_consumer,
                           release_parked)
from kvfleet.ledger import Ledger, Usage
from kvfleet.results import KnownTopics, ResultRelay
from kvfleet.scriptbatch import ScriptBatch
from kvfleet.settings import Settings
from kvfleet.tenancy import Tenancy
from scheduler import metrics as m
from scheduler.dispatch import Dispatcher, Ticket
from scheduler.health import IdleWithLag, serve
from scheduler.intake import Rejected, Tokenize, decode_record, dlq_headers, job_id_hint
from scheduler.offsets import OffsetBook, Revocations
from scheduler.policy import Budget, Decision, PendingJob, Policy, Verdict
from scheduler.wake import BudgetWake

log = logging.getLogger("kvfleet.scheduler")

#: Leases are seconds long, and a reclaim scans the ledger: once a second is enough.
RECLAIM_EVERY_S = 1.0
OBSERVE_EVERY_S = 1.0
#: The idle-with-lag check reads the whole group's offsets (two Kafka round trips).
HEALTH_EVERY_S = 2.0
#: A synchronous commit costs a Kafka round trip (ms); under load, one per this many
#: seconds. A crash then re-reads at most this much of decided records, which intake
#: recognises by their state. When the topics are quiet, commits go out at once.
COMMIT_EVERY_S = 0.1
#: The results relay sends a batch of results, then flushes: a linger lets the batch go
#: as one request (and the flush ends it at once), not one request per result.
RELAY_LINGER_MS = 5
#: The longest a poll's dead letters may take to be acknowledged, s.
DLQ_TIMEOUT_S = 10.0
# kombu's OperationalError: the Celery broker (the state Redis) dropped mid-send;
# DeliveryFailed: Kafka did not take a dead letter.
_FAILURES = (redis.RedisError, KafkaError, DeliveryFailed, OSError, kombu.exceptions.OperationalError)


class MembershipStalled(RuntimeError):
    """The consumer cannot get a partition assignment: the process exits non-zero."""


class RelayStopped(RuntimeError):
    """The results relay's thread died (a bug: it retries every Redis and Kafka error);
    without it no result reaches Kafka, so the process exits non-zero."""


@dataclass(frozen=True)
class Waiting:
    """A job buffered in the policy, and the record it came from."""

    job: PendingJob
    ticket: Ticket
    tp: TopicPartition
    offset: int


class SchedulerService:
    def __init__(self, settings: Settings, consumer: KafkaConsumer, dlq_producer: "confluent_kafka.Producer",
                 dispatcher: Dispatcher, ledger: Ledger, capacity: FleetCapacity, tenancy: Tenancy,
                 tokenize: Callable[[JobRequest], JobRequest], *, relay: Optional[ResultRelay] = None,
                 group_offsets: Callable[[], dict[TopicPartition, int]] = dict,
                 wake: Optional[BudgetWake] = None) -> None:
        self.settings = settings
        self.consumer = consumer
        self.dlq = dlq_producer
        self.dispatcher = dispatcher
        self.store: JobStore = dispatcher.store
        self.ledger = ledger
        self.capacity = capacity
        self.tenancy = tenancy
        self.tokenize = tokenize
        self.relay = relay
        #: Wakes the loop when tokens are freed while jobs wait for budget; None: the
        #: loop polls Kafka for busy_poll_ms instead.
        self.wake = wake
        self._relay_thread: Optional[threading.Thread] = None
        self.policy = Policy(settings.policy, tenancy.tenants)
        self.stopping = threading.Event()
        self.waiting: dict[str, Waiting] = {}  # buffered in the policy, by job id
        self.resend: dict[str, Ticket] = {}  # admitted already: send again, outside the policy
        self.offsets = OffsetBook()
        self.revocations = Revocations(on_revoke=self.pin_rejoin)
        self._rejoined = False  # the membership watchdog rejoined once since the last assignment
        self._priority_of = {t: p for t, p in zip(settings.kafka.topics, Priority)}
        self._topic_of = {p: t for t, p in self._priority_of.items()}
        self._next_reclaim = self._next_observe = self._next_commit = self._next_health = 0.0
        #: The group's committed offsets, every partition (for the idle-with-lag check).
        self.group_offsets = group_offsets
        self.idle = IdleWithLag(settings.scheduler.idle_lag_window_s)
        self.problem: Optional[str] = None  # why /healthz says unhealthy; None: healthy
        self._last_idle_rejoin = float("-inf")
        #: The intake's state reads and the budget's ledger read, sent as one pipeline.
        self._reads: Optional[ScriptBatch] = None
        #: The ledger's usage, read with this step's records' states (`read_states`) for
        #: this step's budget; None: read it there.
        self._usage: Optional[Usage] = None

    def run(self) -> None:
        self.wait_for_topics()
        self.start_relay()
        self.consumer.subscribe(self.settings.kafka.topics, listener=self.revocations)
        log.info("scheduler consuming", extra={"topics": self.settings.kafka.topics, "group": self.settings.kafka.group})
        while not self.stopping.is_set():
            try:
                self.step()
            except _FAILURES as exc:
                # Every step leaves its jobs waiting or settled, never half done: retry.
                m.LOOP_ERRORS.inc()
                log.error("scheduler step failed; retrying in 1 s", extra={"error": f"{type(exc).__name__}: {exc}"})
                self.stopping.wait(1.0)
        log.info("scheduler stopping: stop requested")

    def step(self) -> None:
        self._usage = None  # never a past step's
        records = self.forget_revoked(self.poll())
        self.check_membership()
        self.check_relay()
        self.intake(records)
        self.reclaim()
        now = time.time()
        decision = self.policy.schedule(now, self.budget())
        for p in Priority:
            m.HOLDING.labels(p.value).set(int(decision.holding is not None and decision.holding.priority is p))
        self.dispatch(decision, now)
        self.refuse(decision, now)
        self.pause()
        self.commit(force=not records)
        self.observe()
        self.check_idle()

    def wait_for_topics(self, timeout_s: float = 60.0) -> None:
        """Join the group only once this client has metadata for every topic: a member
        that joins while a just-created topic has no metadata yet is assigned none of its
        partitions, and only a later metadata refresh would fix that."""
        deadline = time.monotonic() + timeout_s
        while not all(self.consumer.partitions_for_topic(t) for t in self.settings.kafka.topics):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Kafka metadata for {self.settings.kafka.topics} after {timeout_s:.0f}s")
            time.sleep(0.2)

    def start_relay(self) -> None:
        if self.relay is None:
            return
        self._relay_thread = threading.Thread(target=self.relay.run, args=(self.stopping,), name="results-relay",
                                              daemon=True)
        self._relay_thread.start()

    def check_relay(self) -> None:
        if self._relay_thread is not None and not self._relay_thread.is_alive() and not self.stopping.is_set():
            raise RelayStopped("the results relay thread died (its traceback is above)")

    def stop_relay(self) -> None:
        """After `stopping` is set: the relay finishes its batch (acked or left pending) and closes."""
        if self._relay_thread is not None:
            self._relay_thread.join(timeout=10)
        if self.relay is not None:
            self.relay.close()

    def poll(self) -> list[ConsumerRecord]:
        s = self.settings.scheduler
        if not (self.policy.pending() or self.resend):
            polled = self.consumer.poll(timeout_ms=s.poll_timeout_ms, max_records=s.max_poll_records)
        else:
            # Jobs wait for budget: take what Kafka holds now, and if nothing, wait for a
            # finishing job's tokens (scheduler/wake.py), at most busy_poll_ms.
            polled = self.consumer.poll(timeout_ms=0, max_records=s.max_poll_records)
            if not polled and self.wake is not None:
                # The jobs of one engine step end within milliseconds of each other: one
                # round for all of their slots, not a round (and a Celery message) each.
                self.wake.wait(s.busy_poll_ms / 1000, gather_s=s.round_gather_ms / 1000)
                polled = self.consumer.poll(timeout_ms=0, max_records=s.max_poll_records)
            elif not polled:
                polled = self.consumer.poll(timeout_ms=s.busy_poll_ms, max_records=s.max_poll_records)
        return [r for rs in polled.values() for r in rs]

    def forget_revoked(self, records: list[ConsumerRecord]) -> list[ConsumerRecord]:
        """Drop the buffered jobs of the partitions a rebalance took, and this poll's
        records of them; the records left."""
        revoked = self.revocations.take()
        if not revoked:
            return records
        # Not committed, so whoever owns them next reads them again; keeping them would
        # admit twice. That may be this replica: kafka-python 3.0.12 revokes every
        # partition in a rebalance (eager) and keeps the fetch position of each one it
        # assigns back to the same member (`SubscriptionState._apply_assignment`,
        # consumer/subscription_state.py 272-303), past the jobs dropped here. Those
        # partitions go back to their oldest record not decided, else to the first record
        # dropped from this poll. One with neither was not read since it was assigned (or
        # sought back), so its position has passed nothing.
        back = {tp: offset for tp in revoked if (offset := self.offsets.position(tp)) is not None}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            if tp in revoked:
                back[tp] = min(back.get(tp, r.offset), r.offset)
        dropped = self.policy.forget({(self._priority_of[tp.topic], tp.partition) for tp in revoked})
        for job in dropped:
            self.waiting.pop(job.job_id, None)
        self.offsets.forget(revoked)
        # Still listed as assigned: given back, or the rebalance is still under way (then
        # the position is dropped with the partition, or kept if it comes back).
        assigned = self.consumer.assignment()
        back = {tp: offset for tp, offset in back.items() if tp in assigned}
        for tp, offset in back.items():
            self.consumer.seek(tp, offset)
        log.info("partitions revoked", extra={"partitions": sorted(map(str, revoked)), "dropped": len(dropped),
                                              "read_again_from": {str(tp): o for tp, o in sorted(back.items())}})
        return [r for r in records if TopicPartition(r.topic, r.partition) not in revoked]

    def pin_rejoin(self) -> None:
        """Keep the coordinator's `rejoin_needed` set until the rebalance that is starting
        completes, so a poll that times out mid-rebalance resumes it on the next poll
        instead of dropping its assignment (kafka-python 3.0.12; `Revocations` says more).
        Private API, hence the guard: a client without it simply goes without the pin."""
        coordinator = getattr(self.consumer, "_coordinator", None)
        if coordinator is not None and hasattr(coordinator, "request_rejoin"):
            coordinator.request_rejoin()

    def check_membership(self) -> None:
        """A member that waits for its assignment much longer than a rebalance takes is
        stuck, while jobs wait on its partitions: rejoin the group from scratch once, and
        if that does not help either, exit non-zero so the supervisor starts a fresh
        process. Nothing is lost either way: the revoked partitions' jobs were dropped
        from the buffer uncommitted, and their next owner reads them again."""
        waited = self.revocations.unassigned_for()
        if waited == 0.0:
            self._rejoined = False
            return
        if waited < self.settings.scheduler.rejoin_after_s:
            return
        if self._rejoined:
            raise MembershipStalled(f"no partition assignment for {waited:.0f} s, even after rejoining the group")
        log.warning("no partition assignment; rejoining the group", extra={"waited_s": round(waited, 1)})
        self._rejoined = True
        self.rejoin()

    def rejoin(self) -> None:
        m.REJOINS.inc()
        self.consumer.unsubscribe()
        self.revocations.restart()
        self.consumer.subscribe(self.settings.kafka.topics, listener=self.revocations)

    def check_idle(self) -> None:
        """Unhealthy while this replica owns no partition and the group's jobs wait
        without their number going down (scheduler/health.py); then rejoin, once per
        window, so a rebalance can move partitions off a member that does not move them."""
        if time.monotonic() < self._next_health:
            return
        self._next_health = time.monotonic() + HEALTH_EVERY_S
        assigned = 0 if self.revocations.unassigned_for() else len(self.consumer.assignment())
        self.problem = self.idle.observe(assigned, self.group_lag() if assigned == 0 else None)
        m.IDLE_WITH_LAG.set(int(self.problem is not None))
        window = self.settings.scheduler.idle_lag_window_s
        if self.problem is not None and time.monotonic() - self._last_idle_rejoin >= window:
            log.warning("scheduler idle while jobs wait; rejoining the group", extra={"reason": self.problem})
            self._last_idle_rejoin = time.monotonic()
            self.rejoin()

    def group_lag(self) -> int:
        """Messages of every request partition that the group has not committed past."""
        tps = [TopicPartition(t, p) for t in self.settings.kafka.topics for p in self.consumer.partitions_for_topic(t) or ()]
        if not tps:
            return 0
        ends, starts = self.consumer.end_offsets(tps), self.consumer.beginning_offsets(tps)
        committed = self.group_offsets()
        return sum(max(0, ends[tp] - max(starts[tp], committed.get(tp, -1))) for tp in tps)

    def intake(self, records: list[ConsumerRecord]) -> None:
        try:
            jobs = self.decode(records)
            states = self.read_states([j.job_id for _, _, j in jobs])
            # Produced without the API (any Kafka client may): record them, tokenized, in
            # one round trip for the poll (a round trip each cost short jobs a tenth).
            new = [i for i, state in enumerate(states) if state is None]
            if new:
                for i in new:
                    tp, offset, job = jobs[i]
                    jobs[i] = (tp, offset, self.tokenize(job))
                for i, (_, state, _) in zip(new, self.store.create_many([jobs[i][2] for i in new])):
                    states[i] = state
        except _FAILURES:
            self.rewind((TopicPartition(r.topic, r.partition), r.offset) for r in records)
            raise
        for i, ((tp, offset, job), state) in enumerate(zip(jobs, states)):
            try:
                self.triage(tp, offset, job, state)
            except _FAILURES:
                self.rewind((tp, offset) for tp, offset, _ in jobs[i:])
                raise

    def read_states(self, job_ids: list[str]) -> list[Optional[JobState]]:
        """The jobs' states, and with them, in the same round trip, the ledger's usage
        that this step's budget reads next: new records are jobs to place, and the two
        reads one after the other cost an idle job's path a round trip (issue 16). The
        usage is a snapshot a moment older than it would be, which no decision relies
        on: other processes change the ledger all the time, and the admission's Lua
        checks the capacity again, atomically."""
        if not job_ids:
            return []
        if self.ledger is None:  # a service built without one (tests of the intake alone)
            return self.store.states(job_ids)
        if self._reads is None:
            self._reads = ScriptBatch(self.store.client)
        replies = self._reads.run_all([*self.store.states_calls(job_ids), self.ledger.usage_call()])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        self._usage = Ledger.decode_usage(replies[-1])
        return JobStore.decode_states(replies[:-1])

    def rewind(self, records: Iterable[tuple[TopicPartition, int]]) -> None:
        """Read these records again on the next poll (the consumer's position has passed
        them): per partition from the oldest, as each partition's records are taken in
        order, none after it was buffered yet."""
        first: dict[TopicPartition, int] = {}
        for tp, offset in records:
            first[tp] = min(first.get(tp, offset), offset)
        for tp, offset in first.items():
            self.consumer.seek(tp, offset)

    def decode(self, records: list[ConsumerRecord]) -> list[tuple[TopicPartition, int, JobRequest]]:
        """Valid jobs; the rest is dead-lettered (flushed before their offsets count as decided)."""
        jobs, dead = [], []
        for record in records:
            tp, priority = TopicPartition(record.topic, record.partition), self._priority_of[record.topic]
            m.CONSUMED.labels(priority.value).inc()
            self.offsets.read(tp, record.offset)
            try:
                jobs.append((tp, record.offset, decode_record(record, priority)))
            except Rejected as rejected:
                dead.append((record, rejected))
        if dead:
            self.dead_letter(dead)
            for record, _ in dead:
                self.offsets.decided(TopicPartition(record.topic, record.partition), record.offset)
        return jobs

    def triage(self, tp: TopicPartition, offset: int, job: JobRequest, state: JobState) -> None:
        """Buffer the job in the policy, queue it to send again, or decide it now."""
        tenant = self.tenancy.get(job.tenant)
        if job.job_id in self.waiting or job.job_id in self.resend or state.terminal or state is JobState.RUNNING:
            # A duplicated or redelivered message: the job's first copy decides its fate.
            self.offsets.decided(tp, offset)
            self.count(job, "cancelled" if state is JobState.CANCELLED else "duplicate")
        elif tenant is None:
            self.store.fail(job.job_id, JobState.REJECTED, "unknown_tenant",
                            f"tenant {job.tenant!r} is not configured", now=time.time())
            self.offsets.decided(tp, offset)
            self.count(job, "rejected", "unknown_tenant")
        elif state is JobState.ADMITTED:
            # Admitted before a crash or rebalance; its task may never have been sent.
            job = self.tokenize(job)
            self.resend[job.job_id] = Ticket(job, job.cost)
            self.offsets.decided(tp, offset)  # durably admitted; a lost resend is reclaimed
        else:
            job = self.tokenize(job)
            pending = PendingJob.from_request(job, tier=tenant.tier, partition=tp.partition)
            self.waiting[job.job_id] = Waiting(pending, Ticket(job, job.cost), tp, offset)
            self.policy.add(pending)

    def reclaim(self) -> None:
        if time.monotonic() < self._next_reclaim:
            return
        self._next_reclaim = time.monotonic() + RECLAIM_EVERY_S
        # Each id goes to exactly one replica, leased to it for one admission lease: if
        # this replica fails before the send below, the lease runs out and the job is
        # reclaimed again (kvfleet/ledger.py), by whichever replica is alive.
        for job_id in self.ledger.reclaim_expired(self.settings.scheduler.admit_lease_s):
            request = self.store.request(job_id)
            if request is None:  # its record expired: nothing left to run
                self.ledger.release(job_id)
                log.warning("reservation without a job record; released", extra={"job_id": job_id})
                continue
            request = self.tokenize(request)
            self.resend[job_id] = Ticket(request, request.cost, revive=True)
            m.RECLAIMED.inc()
            log.warning("reservation lease expired; sending the job again", extra={"job_id": job_id})

    def budget(self) -> Budget:
        if not self.policy.pending():
            return Budget(0, 0)  # nothing buffered to place: spare the two reads
        usage, self._usage = (self._usage if self._usage is not None else self.ledger.usage()), None
        return Budget(self.capacity.read(), usage.in_use, usage.by_tenant, usage.by_class,
                      slots=self.capacity.slots(), jobs=usage.jobs, tenant_class_in_use=usage.by_tenant_class)

    def dispatch(self, decision: Decision, now: float) -> None:
        """The jobs to send again first (they were admitted before), then the policy's choice."""
        chosen = [self.waiting[j.job_id] for j in decision.admit]
        tickets = [*self.resend.values(), *(w.ticket for w in chosen)]
        if not tickets:
            return
        try:
            out = self.dispatcher.dispatch(
                tickets, capacity=self.capacity.read(), slots=self.capacity.slots(), now=now,
                jobs_per_message=min(self.settings.scheduler.jobs_per_message, self.capacity.jobs_per_message()),
                spread=self.capacity.workers())
        except _FAILURES:
            for w in chosen:  # all idempotent: they simply wait and go again
                self.policy.requeue(w.job)
            self.buffer_again([*decision.expire, *decision.reject, *decision.shed])  # `refuse` will not run
            raise
        sent_at = time.time()
        for ticket, previous in out.sent:
            self.sent(ticket, previous, now, sent_at)
        for ticket in out.full:
            if ticket.request.job_id in self.waiting:  # another replica took the tokens first
                self.policy.requeue(self.waiting[ticket.request.job_id].job)
        for ticket, previous in out.skipped:  # cancelled or finished meanwhile
            self.leave(ticket.request, "cancelled" if previous is JobState.CANCELLED else "duplicate")

    def sent(self, ticket: Ticket, previous: JobState, now: float, sent_at: float) -> None:
        job = ticket.request
        if previous is JobState.QUEUED:
            m.QUEUE_DELAY.labels(job.priority.value).observe(max(0.0, now - job.submitted_at))
            log.info("admitted", extra={"job_id": job.job_id, "priority": job.priority.value,
                                        "tenant": job.tenant, "tokens": ticket.tokens, "sent_at": sent_at})
        self.leave(job, "admitted" if previous is JobState.QUEUED else "resent")

    def refuse(self, decision: Decision, now: float) -> None:
        verdicts = [(v, JobState.EXPIRED, "expired") for v in decision.expire]
        verdicts += [(v, JobState.REJECTED, "rejected") for v in decision.reject]
        verdicts += [(v, JobState.REJECTED, "shed") for v in decision.shed]
        for i, (verdict, state, outcome) in enumerate(verdicts):
            try:
                # Only from queued: if a replica that took over the partition (this one
                # having lost its membership unawares) admitted it meanwhile, it runs.
                moved = self.store.fail(verdict.job.job_id, state, verdict.code, verdict.message, now=now,
                                        only_from=frozenset({JobState.QUEUED}))
            except _FAILURES:
                self.buffer_again(v for v, _, _ in verdicts[i:])
                raise
            job = self.waiting[verdict.job.job_id].ticket.request
            if moved.ok:
                self.leave(job, outcome, verdict.code)
            else:
                self.leave(job, "cancelled" if moved.previous == JobState.CANCELLED.value else "duplicate")
            log.info(outcome, extra={"job_id": verdict.job.job_id, "reason": verdict.code})

    def buffer_again(self, verdicts: Iterable[Verdict]) -> None:
        for verdict in verdicts:
            self.policy.add(verdict.job)  # refused again on the next schedule

    def leave(self, job: JobRequest, outcome: str, reason: str = "") -> None:
        """The job leaves the scheduler's hands: its record is decided."""
        waiting = self.waiting.pop(job.job_id, None)
        self.resend.pop(job.job_id, None)
        if waiting is not None:
            self.offsets.decided(waiting.tp, waiting.offset)
        self.count(job, outcome, reason)

    def count(self, job: JobRequest, outcome: str, reason: str = "") -> None:
        m.JOBS.labels(job.priority.value, job.tenant, outcome, reason).inc()

    def pause(self) -> None:
        """Make the consumer's paused partitions the policy's, among those assigned: a
        rebalance forgets pauses of the partitions it moves, so the sets are compared
        rather than patched. Then the records kafka-python parked for a partition paused
        mid-batch are let go of once it is not paused (`release_parked`: kafka-python
        3.0.12 would otherwise never fetch a resumed partition again)."""
        assigned = self.consumer.assignment()
        want = {TopicPartition(self._topic_of[p], n) for p, n in self.policy.paused} & assigned
        have = self.consumer.paused()
        if want - have:
            self.consumer.pause(*(want - have))
        if have - want:
            self.consumer.resume(*(have - want))
        released = release_parked(self.consumer)
        if released:
            log.info("parked records released", extra={"partitions": sorted(map(str, released))})

    def commit(self, *, force: bool = False) -> None:
        if not force and time.monotonic() < self._next_commit:
            return
        due = self.offsets.due()
        if not due:
            return
        self._next_commit = time.monotonic() + COMMIT_EVERY_S
        try:
            self.consumer.commit(offsets=due)
        except CommitFailedError as exc:
            # A rebalance took the partitions; their new owner starts from the last commit.
            log.warning("commit refused", extra={"error": str(exc)})
            return
        self.offsets.committed(due)

    def observe(self) -> None:
        if time.monotonic() < self._next_observe:
            return
        self._next_observe = time.monotonic() + OBSERVE_EVERY_S
        m.CAPACITY.set(self.capacity.read())
        m.IN_USE.set(self.ledger.in_use())
        if self.dlq is not None:
            self.dlq.poll(0)  # librdkafka's log lines; the dead letters' reports come with their flush
        assigned = self.consumer.assignment()
        m.ASSIGNED.set(len(assigned) if not self.revocations.unassigned_for() else 0)
        ends = self.consumer.end_offsets(list(assigned)) if assigned else {}
        for p in Priority:
            m.BUFFERED.labels(p.value).set(self.policy.pending(p))
            m.PAUSED.labels(p.value).set(sum(1 for q, _ in self.policy.paused if q is p))
            m.LAG.labels(p.value).set(sum(end - self.committable(tp) for tp, end in ends.items()
                                          if self._priority_of[tp.topic] is p))

    def committable(self, tp: TopicPartition) -> int:
        """Lag counts from here, not from the fetch position: buffered jobs wait too."""
        position = self.offsets.position(tp)
        return position if position is not None else self.consumer.position(tp)

    def dead_letter(self, dead: list[tuple[ConsumerRecord, Rejected]]) -> None:
        """Copy the records to the dead-letter topic and wait for Kafka's acks; raises
        DeliveryFailed if Kafka did not take them all (their offsets are not decided, so
        the poll's records are read again: at least once, a copy at worst)."""
        hints = [job_id_hint(record) for record, _ in dead]
        outcomes = deliver(self.dlq, [(self.settings.kafka.dlq, record.key, record.value or b"",
                                       dlq_headers(record, rejected, job_id))
                                      for (record, rejected), job_id in zip(dead, hints)], DLQ_TIMEOUT_S)
        failed = [outcome for outcome in outcomes if outcome is not None]
        if failed:
            raise DeliveryFailed(f"Kafka did not take {len(failed)} dead letters: {failed[0]}")
        for (record, rejected), job_id in zip(dead, hints):
            m.DEAD.labels(rejected.reason).inc()
            log.warning("dead-lettered", extra={"job_id": job_id, "reason": rejected.reason, "detail": rejected.detail,
                                                "topic": record.topic, "offset": record.offset})


def build(settings: Settings, *, client_id: str = "kvfleet-scheduler", tenancy: Optional[Tenancy] = None,
          ) -> SchedulerService:
    ensure_topics(settings.kafka)
    client = redis.Redis.from_url(settings.redis.url)
    keys = settings.redis.keys
    s = settings.scheduler
    replica = f"{socket.gethostname()}-{os.getpid()}"
    dispatcher = Dispatcher(JobStore(client, keys), make_celery(settings), settings.redis.key_prefix,
                            lease_s=s.admit_lease_s, replica=replica)
    capacity = FleetCapacity(client, keys, ceiling_tokens=s.capacity_ceiling_tokens or None)
    consumer = make_consumer(settings.kafka, client_id=client_id, max_poll_records=s.max_poll_records,
                             fetch_max_wait_ms=s.fetch_max_wait_ms)
    admin = make_admin(settings.kafka, client_id=f"{client_id}-results")
    group_admin = make_admin(settings.kafka, client_id=f"{client_id}-health")

    def group_offsets() -> dict[TopicPartition, int]:
        offsets = group_admin.list_group_offsets({settings.kafka.group: None}).get(settings.kafka.group, {})
        return {tp: o.offset for tp, o in offsets.items()}

    rdkafka_log = logging.getLogger("kvfleet.rdkafka")
    relay = ResultRelay(client, keys, make_batch_producer(settings.kafka, client_id=f"{client_id}-results",
                                                          logger=rdkafka_log, linger_ms=RELAY_LINGER_MS),
                        KnownTopics(admin.list_topics, close=admin.close), results_topic=settings.kafka.results,
                        reserved_topics=[*settings.kafka.topics, settings.kafka.dlq], consumer=replica,
                        gather_s=s.results_gather_ms / 1000)
    # Tries no longer than a poll waits for it: a dead letter given up on is read again.
    dlq = make_batch_producer(settings.kafka, client_id=f"{client_id}-dlq", logger=rdkafka_log,
                              **{"message.timeout.ms": int(DLQ_TIMEOUT_S * 1000)})
    return SchedulerService(settings, consumer, dlq, dispatcher, Ledger(client, keys), capacity,
                            tenancy or Tenancy.from_settings(settings), Tokenize(settings.model.source), relay=relay,
                            group_offsets=group_offsets, wake=BudgetWake(client, keys.ledger_freed))


def main(argv: Optional[list[str]] = None) -> None:
    settings = Settings.from_env()
    logs.setup("scheduler", settings.log_level)
    service = build(settings)
    if settings.scheduler.metrics_port:
        serve(settings.scheduler.metrics_port, lambda: service.problem)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stopping.set())
    if settings.gc_freeze:
        heap.freeze_startup_heap("scheduler")  # what `build` made lives as long as the process
    try:
        service.run()
        service.commit(force=True)  # what was decided, so the next owner does not re-read it
    except (MembershipStalled, RelayStopped) as exc:
        log.error("scheduler exiting for its supervisor to restart it", extra={"error": str(exc)})
        raise SystemExit(1) from None
    finally:
        service.stopping.set()  # also on an error: the relay thread ends with the loop
        service.consumer.close()  # leaves the group at once so partitions move without waiting
        service.dlq.flush(5)
        service.stop_relay()
        if service.wake is not None:
            service.wake.close()
        log.info("scheduler stopped")


if __name__ == "__main__":
    main()
