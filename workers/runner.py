"""Runs one delivered job, exactly once in effect, whatever Celery delivers.

A delivery may be the first, a redelivery after a worker died, or a duplicate of a job
that is still running elsewhere (the visibility-timeout pitfall, or a scheduler that
dispatched twice). The runner tells them apart with two facts in Redis:
  - the job's state: terminal means done already, so this copy only acknowledges;
  - the job's run lease: held means another copy is executing it right now, so this copy
    waits until that copy finishes (then acknowledges) or dies (then takes over).
The runner reads both, takes the lease and marks the job running in one atomic call
(`JobStore.begin`). The result is written by `JobStore.finish`, which checks that this
runner still holds the lease and releases it in the same call, so even a runner that
stalled past its lease cannot write a second result. A run costs the state Redis two
round trips of its own, begin and finish (the jobs of one message begin together,
`begin_all`, and those that end together finish together, `settle_many`); `RunWatch`
(workers/watch.py) renews the leases of every job running here together. `run` is
`start`, the engine (`call`) and `settle`; workers/batch.py runs the same three steps
for a message's jobs side by side on one thread.

Tokens: the scheduler reserved the job's KV tokens in the ledger when it admitted it;
`begin` moves that reservation to the run lease, `RunWatch` renews both together, and
`finish` releases it in the same Lua call that writes the result. A duplicate copy
never renews, reserves or releases anything.

Cancellation: `DELETE /v1/jobs/{id}` moves the job to `cancelled` and releases its
tokens at once; `RunWatch` sees the state and calls `engine.cancel`, which stops the
job at its next step, and the runner records nothing more (the state is final).

Streaming (with a `StreamPublisher`, workers/streaming.py): each run writes a `start`
with its attempt number, its text as it is generated, and an `end`; the end of a
finished run is written before its result, so a reader that sees the result finds
every piece of the text in the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import msgspec
import redis

from kvfleet import constants
from kvfleet.contracts import (
    Completion,
    JobError,
    JobRequest,
    JobResult,
    JobState,
    Sampling,
    Timings,
    Usage,
    request_from_builtins,
)
from kvfleet.jobstore import BeginArgs, Begun, JobStore
from kvfleet.ledger import Ledger
from kvstore.lock import Lease
from workers.drain import HandBack
from workers.engine import RequestCancelled
from workers.result_cache import ResultCache, determined
from workers.streaming import StreamPublisher
from workers.watch import RunWatch

log = logging.getLogger("kvfleet.worker")


class FaultedRun(HandBack):
    """An engine fault ended this run of the job: requeue its task for another run."""


class Generator(Protocol):
    """What the runner needs from the engine."""

    def generate(self, request_id: str, prompt_tokens: list[int], max_new_tokens: int, sampling: Sampling, *,
                 priority_rank: int = 1, stop: tuple[str, ...] = (),
                 on_token: Optional[Callable[[int], None]] = None, cache_salt: Optional[str] = None) -> Completion: ...

    def cancel(self, request_id: str) -> bool:
        """Stop the request at the next step (`generate` raises RequestCancelled);
        False if the engine does not hold it (not submitted yet, or finished)."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Claim:
    """A run begun before its job reached its thread (`JobRunner.begin_all`): the run
    lease it took (if it took one) and what `JobStore.begin` did."""

    job_id: str
    lease: Lease
    begun: Begun


@dataclass(frozen=True)
class Outcome:
    """How one delivery ended; `label` feeds the task-outcome metric."""

    label: str  # done | failed | expired | cancelled | duplicate | invalid
    job_id: str | None


@dataclass(frozen=True)
class Started:
    """A run past its start (`JobRunner.start`), on its way to the engine."""

    job: JobRequest
    lease: Lease
    begun: Begun
    at: dict[str, Optional[float]]  # the "done" line's hops so far
    prompt: list[int]
    salt: Optional[str]  # the tenant's cache namespace (None: one namespace)
    on_token: Optional[Callable[[int], None]]  # the stream's per-token callback


class JobRunner:
    def __init__(self, store: JobStore, client: redis.Redis, engine: Generator, tokenizer: Tokenizer, *,
                 worker_id: str, lease_s: float = constants.RUN_LEASE_S, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.time, stream: Optional[StreamPublisher] = None,
                 draining: Optional[threading.Event] = None,
                 cache_salt: Optional[Callable[[str], str]] = None, max_job_faults: int = 3,
                 on_fault: Callable[[], object] = lambda: None, results: Optional[ResultCache] = None,
                 result_cache_allowed: Callable[[str], bool] = lambda tenant: False) -> None:
        self.store = store
        self.client = client
        self.engine = engine
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.lease_ms = int(lease_s * 1000)
        self.poll_s = poll_s
        self.clock = clock
        self.stream = stream
        #: Set when the worker drains (workers/drain.py): no new job starts, and a job
        #: the engine cancels is handed back (HandBack), not reported as cancelled.
        self.draining = draining or threading.Event()
        #: tenant -> the root of its KV block hashes (Tenancy.cache_salt): tenants share
        #: cached prefixes only within a namespace. None: one namespace (tests of the runner).
        self.cache_salt = cache_salt
        #: Runs of one job that engine faults may end before it fails, and the worker's
        #: health check, told of every fault (workers/health.py): true once it calls the
        #: worker unhealthy, and then no fault here counts toward a job's failure.
        self.max_job_faults = max_job_faults
        self.on_fault = on_fault
        #: The exact-match result cache (workers/result_cache.py), for requests that ask
        #: for it (`sampling.cache`), of tenants that allow it, whose output is determined.
        self.results = results
        self.result_cache_allowed = result_cache_allowed
        self.watch = RunWatch(store, Ledger(client, store.keys), engine.cancel, lease_s=lease_s)

    def begin_all(self, raws: list[dict]) -> list[Optional[Claim]]:
        """Begin the runs of a several-job message's jobs in one round trip
        (`JobStore.begin_many`), before they go to their threads, instead of one round
        trip each; `run(raw, claim=...)` goes on from there. A job that started is
        watched from now on, so its leases are renewed while it waits for a thread.

        None for a job whose own `run` claims it as a one-job message's would: one that
        does not decode, one whose run lease another copy holds (that wait is
        `_claim`'s), one without a record; all of them while the worker drains, or when
        Redis fails here (each job then tries on its own)."""
        claims: list[Optional[Claim]] = [None] * len(raws)
        if self.draining.is_set():
            return claims
        todo: list[tuple[int, JobRequest, Lease]] = []
        for i, raw in enumerate(raws):
            try:
                job = request_from_builtins(raw)
            except msgspec.ValidationError:
                continue  # `run` records it as invalid
            todo.append((i, job, Lease(self.client, self.store.keys.run_lease(job.job_id), self.lease_ms)))
        try:
            begun = self.store.begin_many([BeginArgs(job.job_id, lease.token, job.deadline) for _, job, lease in todo],
                                          lease_ms=self.lease_ms, now=self.clock(), worker=self.worker_id,
                                          reservation_lease_s=self.lease_ms / 1000)
        except redis.RedisError as exc:
            log.warning("could not begin a message's jobs together; each begins on its own",
                        extra={"error": str(exc)})
            return claims
        for (i, job, lease), b in zip(todo, begun):
            if b.outcome == "started":
                self.watch.add(job.job_id, lease)
            if b.outcome in ("started", "expired", "terminal"):  # decided: the others wait or retry in `_claim`
                claims[i] = Claim(job.job_id, lease, b)
        return claims

    def abandon(self, claim: Claim) -> None:
        """Give up a run `begin_all` began that will not run here (the worker drains, or
        its thread could not be had): stop watching it and free its run lease, so the
        message's redelivery takes the job over at once."""
        self.watch.discard(claim.job_id)
        claim.lease.release()

    def run(self, raw: dict, *, delivered_at: Optional[float] = None, claim: Optional[Claim] = None) -> Outcome:
        """Run one delivered job; `delivered_at`: when its Celery message reached a task
        thread (the "done" log line gives each hop of the job's time from there);
        `claim`: its run, begun already by `begin_all`."""
        picked_at = self.clock()
        try:
            job = request_from_builtins(raw)
        except msgspec.ValidationError as exc:
            # The scheduler validated it; a bad task here means a foreign or corrupt message.
            job_id = raw.get("job_id") if isinstance(raw, dict) else None
            log.error("invalid task payload", extra={"job_id": job_id, "error": str(exc)})
            if isinstance(job_id, str) and self.store.state(job_id) is not None:
                self.store.fail(job_id, JobState.FAILED, "invalid_task", f"the task payload was invalid: {exc}",
                                now=self.clock())
            return Outcome("invalid", job_id if isinstance(job_id, str) else None)
        if self.draining.is_set():
            if claim is not None:  # begun a moment ago: give the run up, as a drain does
                self.abandon(claim)
            raise HandBack(f"worker {self.worker_id} is draining; job {job.job_id} goes back to its queue")
        if claim is None:
            lease = Lease(self.client, self.store.keys.run_lease(job.job_id), self.lease_ms)
            begun = self._claim(job, lease)
        else:
            lease, begun = claim.lease, (None if claim.begun.outcome == "terminal" else claim.begun)
        if begun is None:
            log.info("duplicate delivery; another copy finished or runs the job", extra={"job_id": job.job_id})
            return Outcome("duplicate", job.job_id)
        finished = False
        at = {"delivered": delivered_at or picked_at, "picked": picked_at, "begun": self.clock()}
        try:
            outcome = self._execute(job, lease, begun, at)
            finished = outcome.label == "done"  # its `finish` released the lease with the result
            return outcome
        finally:
            if not finished:
                lease.release()

    def running_jobs(self) -> list[str]:
        """The jobs this worker's engine is generating right now."""
        return self.watch.jobs()

    def _claim(self, job: JobRequest, lease: Lease) -> Optional[Begun]:
        """Take the run lease and start the run (`JobStore.begin`, one round trip); None
        if the job reached a terminal state, or another copy keeps running it for longer
        than its lease could outlive a crash.

        The wait is bounded (issue 13 #5): a duplicate that waited for a live copy
        would hold one of this worker's task threads for the whole job. Giving up is
        safe: the running copy's own task stays unacknowledged until it ends, and its
        ledger reservation stays until its finish, so if that copy dies after we left,
        the scheduler reclaims the reservation and sends the job again."""
        give_up_at = time.monotonic() + 2 * self.lease_ms / 1000
        while True:
            begun = self.store.begin(job.job_id, lease_token=lease.token, lease_ms=self.lease_ms, now=self.clock(),
                                     worker=self.worker_id, reservation_lease_s=self.lease_ms / 1000,
                                     deadline=job.deadline)
            if begun.outcome in ("started", "expired"):
                return begun
            if begun.outcome == "terminal":
                return None
            if begun.outcome == "missing":
                # Dispatched by a path that skipped the API (or the record expired): record
                # it so the job has a truthful state from here on, then begin again.
                self.store.create(job)
                continue
            if time.monotonic() >= give_up_at:  # held
                log.info("another copy keeps running the job; leaving it to that copy", extra={"job_id": job.job_id})
                return None
            # Another copy runs it now. Wait: it either finishes (terminal) or dies and
            # its lease expires (within one lease), after which we take over.
            time.sleep(self.poll_s)

    def _execute(self, job: JobRequest, lease: Lease, begun: Begun, at: dict[str, Optional[float]]) -> Outcome:
        started = self.start(job, lease, begun, at)
        if isinstance(started, Outcome):
            return started
        try:
            completion, from_cache = self.call(started)
        except Exception as exc:  # noqa: BLE001 - settled below, as a batched run settles it
            return self.settle(started, error=exc)
        return self.settle(started, completion, from_cache=from_cache)

    def start(self, job: JobRequest, lease: Lease, begun: Begun, at: dict[str, Optional[float]]) -> "Outcome | Started":
        """Everything of a begun run before the engine: an expired job ends here (its
        Outcome); any other is watched, announced on its stream, and comes back as the
        `Started` run that `call` (or a batched run, workers/batch.py) hands the engine."""
        if begun.outcome == "expired":
            now = self.clock()
            self.store.fail(job.job_id, JobState.EXPIRED, "deadline_passed",
                            f"the job waited {now - job.submitted_at:.1f}s and passed its deadline before it could run",
                            now=now, lease_token=lease.token)
            log.info("expired before start", extra={"job_id": job.job_id})
            return Outcome("expired", job.job_id)
        self.watch.add(job.job_id, lease)
        # Debug: the "done" line carries every hop of the job's time (issue 16: a line
        # per job and state cost the fleet's short jobs a few percent).
        log.debug("running", extra={"job_id": job.job_id, "priority": job.priority.value, "tenant": job.tenant})
        on_token = self._begin_stream(job, begun)
        # The API (or, for a job produced straight to Kafka, the scheduler) tokenized the
        # prompt; only a task sent by a scheduler from before that carries text.
        prompt = job.prompt_tokens if job.prompt_tokens is not None else self.tokenizer.encode(job.prompt or "")
        salt = self.cache_salt(job.tenant) if self.cache_salt else None
        return Started(job, lease, begun, at, list(prompt), salt, on_token)

    def cached(self, started: "Started") -> bool:
        """Whether the run goes through the exact-match result cache (`call`)."""
        job = started.job
        return self.results is not None and job.sampling.cache and determined(job) \
            and self.result_cache_allowed(job.tenant)

    def call(self, started: "Started") -> tuple[Completion, bool]:
        """The engine's completion for the run (blocks), and whether it came from the
        result cache."""
        job = started.job

        def run() -> Completion:
            return self.engine.generate(job.job_id, started.prompt, job.max_new_tokens, job.sampling,
                                        priority_rank=job.priority.rank, stop=tuple(job.sampling.stop),
                                        **({"on_token": started.on_token} if started.on_token is not None else {}),
                                        **({"cache_salt": started.salt} if started.salt is not None else {}))

        if self.cached(started):
            return self.results.get_or_run(msgspec.structs.replace(job, prompt_tokens=started.prompt),
                                           started.salt or "", run)
        return run(), False

    def settle(self, started: "Started", completion: Optional[Completion] = None, *, from_cache: bool = False,
               error: Optional[BaseException] = None) -> Outcome:
        """Record how the engine ended the run: its result, or what its error means
        (cancelled, rejected, a fault); raises HandBack where the job goes back to its
        queue. Each job's own; `settle_many` writes several results in one round trip."""
        if error is not None:
            return self._settle_error(started, error)
        return self.settle_many([(started, completion, from_cache)])[0]

    def settle_many(self, runs: list[tuple["Started", Completion, bool]]) -> list[Outcome]:
        """Record the results of runs the engine finished: the stream's end before each
        result (see the module docstring), then every result in one round trip
        (`JobStore.finish_many`) instead of one each."""
        for started, _, _ in runs:
            self.watch.discard(started.job.job_id)
        results = [self._result(s.job, c, s.begun, from_cache) for s, c, from_cache in runs]
        for (started, _, _), result in zip(runs, results):
            self._end_stream(started.job.job_id, JobState.DONE, text=result.text,
                             finish_reason=result.finish_reason, usage=result.usage)
        written = self.store.finish_many([(r, s.lease.token) for (s, _, _), r in zip(runs, results)])
        outcomes = []
        stored = self.clock()
        for (started, completion, _), w in zip(runs, written):
            job, at = started.job, started.at
            if not w.ok:
                # Lease lost (we stalled past it and another copy took over) or already
                # terminal: the other copy's result stands; ours is dropped, not doubled.
                log.warning("result not written", extra={"job_id": job.job_id, "state": w.previous})
                outcomes.append(Outcome("duplicate", job.job_id))
                continue
            at.update(engine_in=completion.submitted_at, engine_started=completion.started_at,
                      first_token=completion.first_token_at, engine_finished=completion.finished_at, stored=stored)
            log.info("done", extra={"job_id": job.job_id, "completion_tokens": len(completion.tokens),
                                    "cached_tokens": completion.cached_tokens,
                                    "seconds": round(completion.finished_at - completion.started_at, 3),
                                    # Unix seconds of each hop here (bench/fleet_jobs.py `hops`).
                                    "at": at})
            outcomes.append(Outcome("done", job.job_id))
        return outcomes

    def _settle_error(self, started: "Started", exc: BaseException) -> Outcome:
        job, lease, begun = started.job, started.lease, started.begun
        self.watch.discard(job.job_id)
        if isinstance(exc, RequestCancelled):
            if self.draining.is_set() and self.store.state(job.job_id) == JobState.RUNNING:
                # Cancelled by the drain's grace period, not by the client: another
                # worker reruns it (run() releases the lease on the way out).
                log.info("handed back", extra={"job_id": job.job_id})
                raise HandBack(f"worker {self.worker_id} drained before job {job.job_id} finished") from None
            # The API already wrote `cancelled` and released the tokens; nothing to record.
            self._end_stream(job.job_id, JobState.CANCELLED, error=JobError("cancelled", "cancelled by the client"))
            log.info("cancelled", extra={"job_id": job.job_id})
            return Outcome("cancelled", job.job_id)
        if isinstance(exc, ValueError):  # the engine's own input checks (e.g. PromptTooLong)
            self._end_stream(job.job_id, JobState.FAILED, error=JobError("invalid_request", str(exc)))
            self.store.fail(job.job_id, JobState.FAILED, "invalid_request", str(exc), now=self.clock(),
                            lease_token=lease.token)
            log.warning("rejected by engine", extra={"job_id": job.job_id, "error": str(exc)})
            return Outcome("failed", job.job_id)
        if isinstance(exc, Exception):  # an engine fault (StepFailed, a device error), not the job's
            return self._faulted(job, lease, exc, begun.attempt)
        raise exc

    def _begin_stream(self, job: JobRequest, begun: Begun) -> Optional[Callable[[int], None]]:
        """Announce the run (2 and up: the job is rerun from scratch) on the job's stream
        if a client follows it (else the publisher keeps it quiet until one does); the
        engine's per-token callback (None when this worker does not stream)."""
        if self.stream is None:
            return None
        return self.stream.begin(job.job_id, begun.attempt, followed=begun.followed, stop=job.sampling.stop,
                                 stop_token_ids=job.sampling.stop_token_ids)

    def _end_stream(self, job_id: str, status: JobState, **fields) -> None:
        if self.stream is not None:
            self.stream.end(job_id, status, **fields)

    def _faulted(self, job: JobRequest, lease: Lease, exc: Exception, attempt: int) -> Outcome:
        """An infrastructure fault ended this run: the job is not to blame, so it goes
        back to its queue for any worker (`FaultedRun`), up to `max_job_faults` runs;
        then it fails, with the count in its error.

        A fault on a worker the health check has just called (or had called) unhealthy
        is the worker's, whatever the count: the job goes back. A sick worker that took
        the same requeued job up to the limit (it rejects the message and may be first
        to read it again) would otherwise fail a job that runs fine anywhere else. A job
        that makes every engine fault still fails: the next worker's fault counts."""
        message = f"{type(exc).__name__}: {exc}"
        faults = self.store.count_fault(job.job_id)
        worker_sick = bool(self.on_fault())
        if faults < self.max_job_faults or worker_sick:
            log.warning("engine fault; the job goes back to its queue",
                        extra={"job_id": job.job_id, "attempt": attempt, "faults": faults, "error": message,
                               "worker_unhealthy": worker_sick})
            raise FaultedRun(f"engine fault in run {attempt} of job {job.job_id}: {message}") from exc
        message = (f"{message} (engine faults ended {faults} runs of this job, the limit "
                   f"KVFLEET_WORKER_MAX_JOB_FAULTS; the last was attempt {attempt})")
        self._end_stream(job.job_id, JobState.FAILED, error=JobError("worker_error", message))
        self.store.fail(job.job_id, JobState.FAILED, "worker_error", message, now=self.clock(), lease_token=lease.token)
        log.error("engine fault; job failed", extra={"job_id": job.job_id, "attempt": attempt, "faults": faults},
                  exc_info=exc)
        return Outcome("failed", job.job_id)

    def _result(self, job: JobRequest, c: Completion, begun: Begun, from_cache: bool = False) -> JobResult:
        timings = begun.timings if begun.timings.queued_at is not None else \
            msgspec.structs.replace(begun.timings, queued_at=job.submitted_at)
        return JobResult(
            job_id=job.job_id, status=JobState.DONE, tenant=job.tenant, priority=job.priority,
            text=c.text, tokens=c.tokens, finish_reason=c.finish_reason,
            usage=Usage(prompt_tokens=c.prompt_tokens, completion_tokens=len(c.tokens), cached_tokens=c.cached_tokens),
            timings=msgspec.structs.replace(timings, started_at=c.started_at, first_token_at=c.first_token_at,
                                            finished_at=c.finished_at),
            worker=self.worker_id, attempt=begun.attempt, from_cache=from_cache,
        )
