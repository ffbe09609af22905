"""The Celery tasks: run the jobs of one message through this process's engine.

Two task names, one per message shape (scheduler/dispatch.py `pack`): `run_job` carries
one job, as every scheduler has sent it; `run_jobs` carries several, which run side by
side — the task thread runs the first, a per-process pool the others — so that the
engine batches them as it would batch jobs of separate messages; their runs begin in one
round trip before they part (`JobRunner.begin_all`). The task bodies are thin shells
around `JobRunner.run`; the runner (built once per process by
`workers.service`) owns the engine, the job store and the lease logic, and makes every
job of a message exactly-once on its own.

Every job counts in the worker's job gate (workers/gate.py) from the moment its task
starts until it ends: the gate decides which queues the worker's consumer reads next.

A message is acknowledged once every job in it has ended (acks_late). If any of them is
handed back (the worker drains, or an engine fault ended its run), the whole message is
rejected with requeue once the others have ended: on its redelivery the jobs that
finished here are terminal, and `JobStore.begin` turns them into no-ops, so only the
handed-back ones run again. A crash mid-message leaves the message unacknowledged; its
redelivery finds each job finished (a no-op), running elsewhere, or free to take over.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from celery import Celery
from celery.exceptions import Reject
from prometheus_client import Counter

from kvfleet import constants
from workers.drain import HandBack
from workers.gate import JobGate
from workers.runner import Claim, FaultedRun, JobRunner

TASKS = Counter("kvfleet_worker_tasks", "Jobs delivered in Celery tasks, by outcome", ["outcome"])


def register(app: Celery, runner: JobRunner, *, threads: int, gate: Optional[JobGate] = None) -> None:
    """Both task names on `app`; `threads` bounds the jobs of several-job messages that
    run at once beyond each message's first (the engine's batch is a good size);
    `gate` (workers/gate.py) counts the jobs of every task while it runs."""
    gate = gate or JobGate(slots=sys.maxsize, high_slot_reserve=0.0, key_prefix="")  # counts, never closes
    # Threads start as jobs need them, and a thread per job would cost a start each.
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="job")

    def run_one(raw: dict, delivered_at: float, claim: Optional[Claim] = None) -> str:
        try:
            outcome = runner.run(raw, delivered_at=delivered_at, claim=claim)
        except HandBack as exc:
            TASKS.labels("faulted" if isinstance(exc, FaultedRun) else "handed_back").inc()
            raise
        TASKS.labels(outcome.label).inc()
        return outcome.label

    @app.task(name=constants.CELERY_TASK_NAME, acks_late=True, ignore_result=True)
    def run_job(raw: dict) -> str:
        held = gate.hold([raw])
        try:
            return run_one(raw, time.time())
        except HandBack as exc:
            # The worker drains (workers/drain.py), or an engine fault ended the run: the
            # broker puts the message back on its queue now, for another worker (or
            # another run here), instead of after the visibility timeout.
            raise Reject(str(exc), requeue=True) from None
        finally:
            gate.release(held)

    @app.task(name=constants.CELERY_JOBS_TASK_NAME, acks_late=True, ignore_result=True)
    def run_jobs(raws: list[dict]) -> list[str]:
        if not raws:
            return []
        held = gate.hold(raws)
        try:
            return run_all(raws)
        finally:
            gate.release(held)

    def run_all(raws: list[dict]) -> list[str]:
        delivered_at = time.time()
        claims = runner.begin_all(raws)  # one round trip for every job's `begin`
        others: list[Future[str]] = []
        try:
            for raw, claim in zip(raws[1:], claims[1:]):
                others.append(pool.submit(run_one, raw, delivered_at, claim))
        except RuntimeError:
            # The pool is shut down (the process exits): the jobs not given to a thread
            # give their runs up; the message stays unacknowledged and comes back.
            for claim in [claims[0], *claims[1 + len(others):]]:
                if claim is not None:
                    runner.abandon(claim)
            raise
        outcomes: list[str | BaseException] = []
        try:
            outcomes.append(run_one(raws[0], delivered_at, claims[0]))
        except Exception as exc:  # noqa: BLE001 - decided below, once every job has ended
            outcomes.append(exc)
        for future in others:
            # Every job ends before the message is acked or rejected: a message requeued
            # while one of its jobs still ran here would only meet that job's run lease.
            exc = future.exception()
            outcomes.append(exc if exc is not None else future.result())
        handed_back = [o for o in outcomes if isinstance(o, HandBack)]
        if handed_back:
            # Requeued whole; its finished jobs are no-ops when it comes back (above).
            raise Reject(f"{len(handed_back)} of {len(raws)} jobs handed back: {handed_back[0]}",
                         requeue=True) from None
        for o in outcomes:
            if isinstance(o, BaseException):
                # An error the runner could not record (the state Redis gone mid-run): the
                # message stays unacknowledged and comes back after the visibility timeout.
                raise o
        return [str(o) for o in outcomes]
