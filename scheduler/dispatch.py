"""Admitting jobs: reserve their tokens and record them admitted, then hand them to
Celery. In batches, and safe to repeat for the same job.

Order and why: `JobStore.admit_many` reserves and moves `queued → admitted` in one Lua
call per job (one round trip per batch), then the tasks are sent (one more, through
kombu's publish batch). If the scheduler dies between the two, the Kafka offset was
not committed, the message comes back, the job is found `admitted` and sent again
without reserving twice; if it never comes back (another replica committed past it),
the reservation's lease runs out and `reclaim` sends it. A duplicate task is harmless:
the worker's run lease and the one-way states turn it into a no-op.

Messages: the jobs of one round go to their class's queue in messages of several jobs
(`pack`), because a worker's Celery consumer pays per message (a read, an unacked
record, an ack) whatever it carries. A worker's task thread takes one message and runs
its jobs side by side (workers/tasks.py), so a message is also the unit of load
balance: a round is cut into at least `spread` messages (the live workers: each
worker's consumer takes the next message when it asks, so a round reaches all of them),
and a round larger than that packs. A message of one job is the one-job task, the only
one older workers know; `FleetCapacity.jobs_per_message` keeps the packing to what
every live worker takes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from celery import Celery

from kvfleet import constants
from kvfleet.contracts import JobRequest, JobState, to_builtins
from kvfleet.jobstore import Admit, JobStore


@dataclass(frozen=True)
class Ticket:
    """A job on its way to a worker, with the tokens it reserves."""

    request: JobRequest
    tokens: int
    revive: bool = False  # reclaimed from a dead worker: may be running, send it anyway


@dataclass
class Dispatched:
    sent: list[tuple[Ticket, JobState]] = field(default_factory=list)  # with the state before admission
    full: list[Ticket] = field(default_factory=list)  # the ledger had no room: try again later
    skipped: list[tuple[Ticket, JobState | None]] = field(default_factory=list)  # cancelled, running, finished


def pack(jobs: Sequence[JobRequest], most: int, spread: int = 0) -> list[list[JobRequest]]:
    """The messages that carry `jobs`: grouped by class (each class has its queue), in
    order, each message of at most `most` jobs and each class's jobs in at least
    `spread` messages (0: `most`; one per job, if fewer jobs). With two workers
    (`spread` 2), 8 jobs go out in two messages of four, 64 in four of sixteen; with
    the default, a message never holds more than about 1/`most` of a class's round until
    the round passes `most`² jobs: 8 jobs go out one per message, 64 in sixteen of four."""
    spread = spread or most
    by_class: dict[str, list[JobRequest]] = defaultdict(list)
    for job in jobs:
        by_class[job.priority.value].append(job)
    messages = []
    for group in by_class.values():
        size = max(1, min(most, math.ceil(len(group) / spread)))
        messages += [group[i:i + size] for i in range(0, len(group), size)]
    return messages


class Dispatcher:
    def __init__(self, store: JobStore, celery: Celery, key_prefix: str, *, lease_s: float, replica: str) -> None:
        self.store = store
        self.celery = celery
        self.key_prefix = key_prefix
        self.lease_s = lease_s
        self.replica = replica

    def dispatch(self, tickets: Sequence[Ticket], *, capacity: int, now: float, slots: int = 0,
                 jobs_per_message: int = 1, spread: int = 0) -> Dispatched:
        """Reserve, admit and send each ticket, in order, within `capacity` tokens and
        `slots` jobs (0 = no limit), in messages of up to `jobs_per_message` jobs, each
        class's in at least `spread` messages (`pack`).
        Raises on a Redis or broker error; every step is idempotent, so the caller
        simply tries the tickets again."""
        out = Dispatched()
        if not tickets:
            return out
        admits = [Admit(t.request.job_id, t.tokens, t.request.tenant, t.request.priority, t.revive) for t in tickets]
        for ticket, a in zip(tickets, self.store.admit_many(admits, capacity=capacity, lease_s=self.lease_s,
                                                             now=now, by=self.replica, max_jobs=slots)):
            if a.reserved:
                out.sent.append((ticket, a.previous))
            elif a.full:
                out.full.append(ticket)
            else:
                out.skipped.append((ticket, a.previous))
        self.send(pack([t.request for t, _ in out.sent], jobs_per_message, spread))
        return out

    def send(self, messages: Sequence[Sequence[JobRequest]]) -> None:
        """Each list of jobs as one Celery message, all in one Redis round trip (kombu
        pipelines a batch's LPUSHes); the jobs of one message share a class.

        `argsrepr` keeps the prompts out of the message headers (Celery would repr the
        whole request there, doubling the message and logging the prompt), and
        `retry=False` because a failed batch is retried by the caller, not task by task.
        """
        if not messages:
            return
        with self.celery.producer_or_acquire() as producer, producer.batch():
            for jobs in messages:
                first = jobs[0]
                if len(jobs) == 1:
                    name, args = constants.CELERY_TASK_NAME, [to_builtins(first)]
                else:
                    name, args = constants.CELERY_JOBS_TASK_NAME, [[to_builtins(job) for job in jobs]]
                self.celery.send_task(
                    name, args=args, producer=producer,
                    queue=constants.celery_queue(self.key_prefix, first.priority),
                    # Celery's own logs then carry a job id too (a task id need not be unique
                    # here: results are ignored, and the broker acks by delivery tag).
                    task_id=first.job_id,
                    argsrepr=f"({', '.join(repr(j.job_id) for j in jobs)},)", kwargsrepr="{}", retry=False,
                )
