"""Admitting a job: record it, then hand it to Celery. Safe to repeat for the same job.

Order and why: the state moves `queued → admitted` first, then the task is sent. If
the scheduler dies between the two, the Kafka offset was not committed, the message
comes back, the job is found `admitted`, and it is sent again — a duplicate task that
the worker's run lease and one-way states turn into a no-op. The reverse order could
send a task and then die before recording it, which is equally safe but makes the state
lag the truth; recording first keeps `admitted` meaning "a task exists or is about to".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from celery import Celery

from kvfleet import constants
from kvfleet.contracts import JobRequest, JobState, to_builtins
from kvfleet.jobstore import JobStore

log = logging.getLogger("kvfleet.scheduler")


@dataclass(frozen=True)
class Admission:
    """What became of one job: dispatched, expired, or skipped as a duplicate."""

    outcome: str  # dispatched | expired | duplicate
    state: JobState


class Dispatcher:
    def __init__(self, store: JobStore, celery: Celery, key_prefix: str) -> None:
        self.store = store
        self.celery = celery
        self.key_prefix = key_prefix

    def admit(self, job: JobRequest, *, now: float) -> Admission:
        state = self.store.state(job.job_id)
        if state is None:
            # Produced without going through the API (any Kafka client may): record it.
            _, state, _ = self.store.create(job)
        if state.terminal or state is JobState.RUNNING:
            # Redelivered or duplicated message of a job that is running or finished.
            return Admission("duplicate", state)
        if job.deadline is not None and now > job.deadline:
            self.store.fail(job.job_id, JobState.EXPIRED, "deadline_passed",
                            f"the job waited {now - job.submitted_at:.1f}s in the queue and passed its deadline",
                            now=now)
            return Admission("expired", JobState.EXPIRED)
        if state is JobState.QUEUED:
            moved = self.store.transition(job.job_id, JobState.ADMITTED, admitted_at=now)
            if not moved.ok and moved.previous != JobState.ADMITTED.value:
                # Cancelled or finished between our read and the transition.
                return Admission("duplicate", JobState(moved.previous) if moved.previous else state)
        self.send(job)
        return Admission("dispatched", JobState.ADMITTED)

    def send(self, job: JobRequest) -> None:
        self.celery.send_task(
            constants.CELERY_TASK_NAME,
            args=[to_builtins(job)],
            queue=constants.celery_queue(self.key_prefix, job.priority),
            task_id=job.job_id,  # Celery's own logs then carry the job id too
        )
