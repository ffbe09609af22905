"""Runs the begun jobs of one several-job Celery message side by side on its task thread.

A thread per job, each blocked in `engine.generate`, cost short jobs more than the
engine did (issue 16): a thread hand-off at each end of every job, each of its Redis
calls made alone (or queued behind the others' through a ScriptBatch, a wake-up each),
and every one of those threads contending for the GIL the engine's step thread needs.
Here the task thread drives its message's jobs instead:

1. the prefix step for all of them at once (workers/prefix.py `start_many`): the cold
   tier's lookups in one round trip, the single flights' claims in another, and each
   job submitted to the engine without waiting;
2. one wait, on one queue, for what the step thread reports: a builder's prompt is
   computed, or a job ended;
3. the jobs that ended together settle together (`JobRunner.settle_many`): every
   stream's end, then every result in one round trip; then the flights of the builds
   reported together end (the waiter counts and releases of all of them share one
   round trip), after the results, which is what a client waits for.

Each job keeps its own run lease, its own outcome and its own exactly-once guarantees:
what `JobRunner.run` does for one job, in the same order, batched only where Redis
calls of different jobs meet. A job whose run must block (the result cache, cold
blocks to load, a flight another worker holds) is left to a pool thread, as before.
"""

from __future__ import annotations

import logging
import queue
from typing import Callable, Optional, Sequence, Union

import redis

from workers.engine import Engine, RequestHandle
from workers.prefix import Request, Running
from workers.runner import JobRunner, Outcome, Started

log = logging.getLogger("kvfleet.worker")

Ended = Union[Outcome, BaseException]
StartMany = Callable[[Sequence[Request], Callable[[int], None]], list[Optional[Running]]]


def run_side_by_side(runner: JobRunner, starts: Sequence[Started]) -> list[Optional[Ended]]:
    """Run the started jobs through the engine together; each one's Outcome (or the
    error its settling raised: HandBack, a Redis error), or None for a job this thread
    left alone (its caller runs it as `JobRunner` would on a thread of its own). Every
    job run here has ended when this returns, and each that did not end `done` has
    released its run lease, as `JobRunner.run` does."""
    start_many, end_builds = _driver(runner.engine)
    ended: list[Optional[Ended]] = [None] * len(starts)
    if start_many is None or not starts:
        return ended
    events: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
    requests = [Request(s.job.job_id, s.prompt, s.job.max_new_tokens, s.job.sampling,
                        priority_rank=s.job.priority.rank, stop=tuple(s.job.sampling.stop),
                        on_token=s.on_token, cache_salt=s.salt) for s in starts]
    running = start_many(requests, lambda i: events.put(("computed", i)))
    pending = 0
    for i, run in enumerate(running):
        if run is not None:
            pending += 1
            run.handle.add_done_callback(lambda _, i=i: events.put(("done", i)))
    builds_ended: set[int] = set()
    while pending:
        reported = [events.get()]
        while True:  # everything reported meanwhile: one round trip for all of it
            try:
                reported.append(events.get_nowait())
            except queue.Empty:
                break
        builds = []
        for kind, i in reported:
            build = running[i].build
            if build is None or i in builds_ended:
                continue
            if kind == "computed" and starts[i].job.max_new_tokens == 1:
                # Its end follows in the same step: its build ends with its "done", after
                # its result, not a round trip before it (the thread may wake in between).
                continue
            builds_ended.add(i)
            builds.append(build)
        done = [i for kind, i in reported if kind == "done"]
        try:
            # The jobs that ended first: their results are what clients wait for, and a
            # 1-token job's end is reported with its build's; the builds' stores and
            # releases only let waiters go (another job's prefix), a round trip later.
            _settle(runner, [(i, starts[i], running[i].handle) for i in done], ended)
        finally:
            if builds:  # always: a flight left held would stall its waiters for a lock's lifetime
                end_builds(builds)
        pending -= len(done)
    return ended


def _settle(runner: JobRunner, done: list[tuple[int, Started, RequestHandle]], ended: list[Optional[Ended]]) -> None:
    finished = []
    for i, started, handle in done:
        try:
            finished.append((i, started, handle.result()))
        except Exception as exc:  # noqa: BLE001 - the run's error: settled as `JobRunner.run` settles it
            try:
                ended[i] = runner.settle(started, error=exc)
            except Exception as settled:  # noqa: BLE001 - HandBack, or Redis gone: the caller decides
                ended[i] = settled
    if finished:
        try:
            outcomes: list[Ended] = list(runner.settle_many([(s, c, False) for _, s, c in finished]))
        except Exception as exc:  # noqa: BLE001 - the state Redis failed: the message comes back
            outcomes = [exc] * len(finished)
        for (i, _, _), outcome in zip(finished, outcomes):
            ended[i] = outcome
    for i, started, _ in done:
        if not (isinstance(ended[i], Outcome) and ended[i].label == "done"):  # `finish` released it with the result
            try:
                started.lease.release()
            except redis.RedisError as exc:  # it expires within one lease
                log.warning("could not release a run lease", extra={"job_id": started.job.job_id, "error": str(exc)})


def _driver(generator: object) -> tuple[Optional[StartMany], Callable[[list], None]]:
    """How to submit several jobs without blocking on this generator, and how to end
    their prefix builds; (None, ...) for one that can only `generate` (test doubles)."""
    start_many = getattr(generator, "start_many", None)
    if start_many is not None:
        return start_many, generator.end_builds  # type: ignore[attr-defined]
    if isinstance(generator, Engine):
        def submit_all(requests: Sequence[Request], computed: Callable[[int], None]) -> list[Optional[Running]]:
            return [_submit(generator, r) for r in requests]
        return submit_all, lambda builds: None
    return None, lambda builds: None


def _submit(engine: Engine, r: Request) -> Optional[Running]:
    try:
        return Running(engine.submit(r.request_id, r.prompt, r.max_new_tokens, r.sampling,
                                     priority_rank=r.priority_rank, stop=r.stop, on_token=r.on_token,
                                     cache_salt=r.cache_salt))
    except Exception:  # noqa: BLE001 - the engine's input checks: the job's own thread meets them again
        return None
