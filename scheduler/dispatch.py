"""Admitting jobs: reserve their tokens and record them admitted, then hand them to
Celery. In batches, and safe to repeat for the same job.

Order and why: `JobStore.admit_many` reserves and moves `queued → admitted` in one Lua
call per job (one round trip per batch), then the tasks are sent (one more, through
kombu's publish batch). If the scheduler dies between the two, the Kafka offset was
not committed, the message comes back, the job is found `admitted` and sent again
without reserving twice; if it never comes back (another replica committed past it),
the reservation's lease runs out and `reclaim` sends it. A duplicate task is harmless:
the worker's run lease and the one-way states turn it into a no-op.
"""

from __future__ import annotations

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


class Dispatcher:
    def __init__(self, store: JobStore, celery: Celery, key_prefix: str, *, lease_s: float, replica: str) -> None:
        self.store = store
        self.celery = celery
        self.key_prefix = key_prefix
        self.lease_s = lease_s
        self.replica = replica

    def dispatch(self, tickets: Sequence[Ticket], *, capacity: int, now: float, slots: int = 0) -> Dispatched:
        """Reserve, admit and send each ticket, in order, within `capacity` tokens and
        `slots` jobs (0 = no limit). Raises on a Redis or broker error; every step is
        idempotent, so the caller simply tries the tickets again."""
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
        self.send([t.request for t, _ in out.sent])
        return out

    def send(self, jobs: Sequence[JobRequest]) -> None:
        """All tasks in one Redis round trip (kombu pipelines a batch's LPUSHes).

        `argsrepr` keeps the prompt out of the message headers (Celery would repr the
        whole request there, doubling the message and logging the prompt), and
        `retry=False` because a failed batch is retried by the caller, not task by task.
        """
        if not jobs:
            return
        with self.celery.producer_or_acquire() as producer, producer.batch():
            for job in jobs:
                self.celery.send_task(
                    constants.CELERY_TASK_NAME, args=[to_builtins(job)], producer=producer,
                    queue=constants.celery_queue(self.key_prefix, job.priority),
                    task_id=job.job_id,  # Celery's own logs then carry the job id too
                    argsrepr=f"({job.job_id!r},)", kwargsrepr="{}", retry=False,
                )
