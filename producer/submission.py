"""The one submit path every route takes (native `/v1/jobs`, OpenAI completions and chat):
admission, the job's state, then Kafka.

    existing = await submit(ctx, tenant, job, client_id=...)

Order matters for "nothing lost, nothing run twice":
- a job resubmitted under its own `job_id` by its own tenant is answered with the
  existing job before any check, so a retry never pays the quota twice; if that job is
  still queued it is produced again (from its record), since the first submission may
  have died before its produce (a second copy on Kafka is recognised by its id and
  skipped by the scheduler);
- the quota and the `queued` record in one Redis call, then Kafka (producer/records.py
  says why): a failed produce takes the record back, so a client retrying under the
  same `job_id` gets one run.

Every step is awaited on the event loop and none holds a thread: the record's Lua call
through redis.asyncio, the produce through the producer's callbacks
(producer/publisher.py). A job without a client id waits on one Redis round trip and
the produce, nothing else. `kvfleet_api_submit_step_seconds{step}` times each step.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Optional, TypeVar

import msgspec
import redis
from prometheus_client import Counter, Histogram

from kvfleet.contracts import JobRequest, JobResult, JobState, decode_request, encode
from kvfleet.tenancy import Tenant
from producer.context import ApiContext
from producer.errors import Conflict, QueueUnavailable, StoreUnavailable

log = logging.getLogger("kvfleet.api")
T = TypeVar("T")

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])
STEP = Histogram("kvfleet_api_submit_step_seconds",
                 "Time of each step of a submission: parse (body, tenant, validation, tokens), admit (idempotency, "
                 "admission, the quota and the queued record), produce (until Kafka acknowledged)", ["step"],
                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
PARSE, ADMIT, PRODUCE = (STEP.labels(step) for step in ("parse", "admit", "produce"))


async def submit(ctx: ApiContext, tenant: Tenant, job: JobRequest, *, client_id: bool,
                 output_field: str = "max_new_tokens") -> Optional[JobResult]:
    """Queue `job`; None when it was queued now, or the existing job when the client
    resubmitted an id it used before (`client_id`: the id came from the client).
    Raises Refused / QueueUnavailable / StoreUnavailable / Conflict (the id is another tenant's)."""
    started = time.perf_counter()
    if client_id:
        existing = await _store(ctx, job, ctx.read(job.job_id))
        if existing is not None:
            _check_owner(existing.tenant, tenant, job)
            if existing.status is not JobState.QUEUED or await _produce_again(ctx, job):
                return existing
            # Its record went meanwhile (taken back: Kafka refused that submission): a new one.
    ctx.gate.check(tenant, job, output_field=output_field)
    encoded = encode(job)
    charged = ctx.gate.quota_of(tenant)
    outcome = await _store(ctx, job, ctx.records.submit(job, encoded, charged))
    if outcome.over_quota is not None:
        raise ctx.gate.over_quota(tenant, job, outcome.over_quota, output_field=output_field)
    admitted = time.perf_counter()
    ADMIT.observe(admitted - started)
    if not outcome.created:  # the id was recorded meanwhile: a concurrent submission of it
        _check_owner(outcome.owner, tenant, job)
        if outcome.state is JobState.QUEUED and not await _produce_again(ctx, job):
            raise QueueUnavailable(f"job {job.job_id!r} was being submitted by another request, which Kafka "
                                   "refused; nothing was queued: retry later with the same job_id", job_id=job.job_id)
        return None
    try:
        await ctx.publisher.publish(job, encoded)
    except QueueUnavailable:
        await _take_back(ctx, job, encoded, charged)
        raise
    PRODUCE.observe(time.perf_counter() - admitted)
    SUBMITTED.labels(job.priority.value).inc()
    return None


async def _store(ctx: ApiContext, job: JobRequest, call: Awaitable[T]) -> T:
    """A Redis call before the produce: if Redis fails nothing is on Kafka, so the
    client may simply retry."""
    try:
        return await call
    except redis.RedisError as exc:
        log.error("job store unavailable", extra={"job_id": job.job_id, "error": str(exc)})
        raise StoreUnavailable(f"the job store is unavailable ({exc}); nothing was queued: retry later with the "
                               "same job_id", job_id=job.job_id) from exc


def _check_owner(owner: str, tenant: Tenant, job: JobRequest) -> None:
    if owner != tenant.name:
        raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out", param="job_id")


async def _produce_again(ctx: ApiContext, job: JobRequest) -> bool:
    """Produce a queued job again, as it was recorded (not as resubmitted: a second body
    under the same id must not run uncharged); False if its record is gone. A 503 here
    takes nothing back."""
    recorded = await _store(ctx, job, ctx.records.recorded_request(job.job_id))
    if recorded is None:
        return False
    try:
        request = decode_request(recorded)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:  # a Redis blob is input too
        log.error("unreadable job record", extra={"job_id": job.job_id, "error": str(exc)})
        raise StoreUnavailable(f"job {job.job_id!r} has an unreadable record; nothing was queued",
                               job_id=job.job_id) from exc
    await ctx.publisher.publish(request, recorded)
    return True


async def _take_back(ctx: ApiContext, job: JobRequest, encoded: bytes, charged: Optional[Tenant]) -> None:
    """Kafka refused the job: remove its record and give its tokens back."""
    try:
        await ctx.records.undo(job, encoded, charged)
    except redis.RedisError as exc:
        # The record stays queued with nothing on Kafka: a retry under the same job_id
        # produces it again (`_produce_again`); an id nobody resubmits expires.
        log.error("could not take back the record of a job Kafka refused",
                  extra={"job_id": job.job_id, "error": str(exc)})
