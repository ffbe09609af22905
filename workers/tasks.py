"""The Celery tasks: run the jobs of one message through this process's engine.

Two task names, one per message shape (scheduler/dispatch.py `pack`): `run_job` carries
one job, as every scheduler has sent it; `run_jobs` carries several. Both take one
path: the message's runs begin in one round trip (`JobRunner.begin_all`), and then the
task thread runs them side by side itself (workers/batch.py): their prefix step
together, each submitted to the engine without waiting, one wait for all, and the
results of jobs that end together written in one round trip, before their prefix
flights end. A job whose run must block (the result cache, a cold load, a prefix flight
another worker holds, a copy running elsewhere) goes to a per-process pool thread
instead, as every job of a message did before issue 16 (a thread per job cost short
jobs more than the engine did); the one job of a one-job message stays on its task
thread. The runner (built once per process by
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
from kvfleet.contracts import request_from_builtins
from workers.batch import run_side_by_side
from workers.drain import HandBack
from workers.gate import JobGate
from workers.runner import Claim, FaultedRun, JobRunner, Outcome, Started

TASKS = Counter("kvfleet_worker_tasks", "Jobs delivered in Celery tasks, by outcome", ["outcome"])


def register(app: Celery, runner: JobRunner, *, threads: int, gate: Optional[JobGate] = None) -> None:
    """Both task names on `app`; `threads` bounds the jobs of several-job messages that
    run on a thread of their own at once (the engine's batch is a good size);
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

    @app.task(name=constants.CELERY_TASK_NAME, acks_late=True, ignore_result=True, shared=False)
    def run_job(raw: dict) -> str:
        # A message of one job takes a several-job message's path (`run_all`): its
        # result is written before its prefix flight ends (workers/batch.py), where
        # `JobRunner.run` ends the flight first, a round trip before the result.
        held = gate.hold([raw])
        try:
            return run_all([raw])[0]
        finally:
            gate.release(held)

    @app.task(name=constants.CELERY_JOBS_TASK_NAME, acks_late=True, ignore_result=True, shared=False)
    def run_jobs(raws: list[dict]) -> list[str]:
        if not raws:
            return []
        held = gate.hold(raws)
        try:
            return run_all(raws)
        finally:
            gate.release(held)

    def run_started(started: Started) -> str:
        """A started run that must block (the result cache, a cold load, another
        worker's flight), on a thread of its own: what `JobRunner.run` does from there."""
        outcome: Optional[Outcome] = None
        try:
            try:
                completion, from_cache = runner.call(started)
            except Exception as exc:  # noqa: BLE001 - settled as `JobRunner.run` settles it
                outcome = runner.settle(started, error=exc)
            else:
                outcome = runner.settle(started, completion, from_cache=from_cache)
        except HandBack as exc:
            TASKS.labels("faulted" if isinstance(exc, FaultedRun) else "handed_back").inc()
            raise
        finally:
            if outcome is None or outcome.label != "done":  # `finish` released it with the result
                started.lease.release()
        TASKS.labels(outcome.label).inc()
        return outcome.label

    def run_all(raws: list[dict]) -> list[str]:
        delivered_at = time.time()

        claims = runner.begin_all(raws)  # one round trip for every job's `begin`
        # A job begun here is picked by this thread on delivery (no hand-off): its
        # moments say so, and put the `begin` round trip between picked and begun.
        begun_at = time.time()
        outcomes: list[str | BaseException | None] = [None] * len(raws)
        threads: list[tuple[int, Future[str]]] = []

        def on_a_thread(i: int, fn, *args) -> None:
            """Job i, whose run blocks: on a pool thread of its own; a one-job message's
            on its task thread, where nothing else waits (no hand-off each way)."""
            if len(raws) > 1:
                threads.append((i, pool.submit(fn, *args)))
            else:
                outcomes[i] = capture(fn, *args)

        begun: list[tuple[int, Claim]] = []
        try:
            for i, (raw, claim) in enumerate(zip(raws, claims)):
                if claim is None:  # its own `run` claims it, and may wait for another copy
                    on_a_thread(i, run_one, raw, delivered_at)
                else:
                    begun.append((i, claim))
        except RuntimeError:
            # The pool is shut down (the process exits): the jobs not given to a thread
            # give their runs up; the message stays unacknowledged and comes back.
            for claim in claims:
                if claim is not None:
                    runner.abandon(claim)
            raise
        starts: list[tuple[int, Started]] = []
        for i, claim in begun:
            if claim.begun.outcome != "started" or runner.draining.is_set():
                outcomes[i] = capture(run_one, raws[i], delivered_at, claim)  # no engine: done at once
                continue
            try:
                started = runner.start(request_from_builtins(raws[i]), claim.lease, claim.begun,
                                       {"delivered": delivered_at, "picked": delivered_at, "begun": begun_at})
            except Exception as exc:  # noqa: BLE001 - decided below, once every job has ended
                claim.lease.release()
                runner.watch.discard(claim.job_id)
                outcomes[i] = exc
                continue
            starts.append((i, started))
        # The jobs the engine can take without a thread each (workers/batch.py); the
        # others, each on a thread of its own.
        side = [(i, s) for i, s in starts if not runner.cached(s)]
        ended = run_side_by_side(runner, [s for _, s in side])
        left = [(i, s) for (i, s), e in zip(side, ended) if e is None] + [(i, s) for i, s in starts if runner.cached(s)]
        for (i, _), e in zip(side, ended):
            if e is not None:
                outcomes[i] = e
                if isinstance(e, Outcome):
                    TASKS.labels(e.label).inc()
                elif isinstance(e, HandBack):
                    TASKS.labels("faulted" if isinstance(e, FaultedRun) else "handed_back").inc()
        for i, started in left:
            try:
                on_a_thread(i, run_started, started)
            except RuntimeError:  # the pool is shut down: run it here
                outcomes[i] = capture(run_started, started)
        for i, future in threads:
            # Every job ends before the message is acked or rejected: a message requeued
            # while one of its jobs still ran here would only meet that job's run lease.
            exc = future.exception()
            outcomes[i] = exc if exc is not None else future.result()
        ended_as = [o.label if isinstance(o, Outcome) else o for o in outcomes]
        handed_back = [o for o in ended_as if isinstance(o, HandBack)]
        if handed_back:
            # Requeued whole; its finished jobs are no-ops when it comes back (above).
            raise Reject(f"{len(handed_back)} of {len(raws)} jobs handed back: {handed_back[0]}",
                         requeue=True) from None
        for o in ended_as:
            if isinstance(o, BaseException):
                # An error the runner could not record (the state Redis gone mid-run): the
                # message stays unacknowledged and comes back after the visibility timeout.
                raise o
        return [str(o) for o in ended_as]


def capture(fn, *args) -> "str | BaseException":
    """`fn(*args)`, or the exception it raised (decided once every job of the message has ended)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return exc
