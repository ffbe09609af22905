"""Submitting a validated job: the steps every route that creates a job shares.

`POST /v1/jobs`, `POST /v1/completions` and `POST /v1/chat/completions` each turn
their own request shape into a `JobRequest`, then call `submit`:

    resubmitted id?  ->  the existing job (same tenant), nothing charged, nothing queued
    admission        ->  `Gate.check`: ceiling 422, backlog 429, bronze overload 503,
                         quota 413 / 429 (the quota is charged here, last)
    Kafka first      ->  `Publisher.publish` (acks=all; 503 if Kafka refuses)
    then the state   ->  `JobStore.create` ("queued")

Kafka before Redis (producer/publisher.py says why): a failed produce records nothing,
so a retry under the same job_id runs the job once.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import anyio
from prometheus_client import Counter, Histogram

from kvfleet.contracts import JobRequest, JobResult, JobState, Priority
from kvfleet.tenancy import Tenant
from producer.context import ApiContext
from producer.errors import BadRequest, Conflict
from producer.validation import FieldNames

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])
LATENCY = Histogram("kvfleet_api_request_duration_seconds", "HTTP handling time", ["route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


class Submitted(NamedTuple):
    job_id: str
    state: JobState
    #: False: the client's job_id named a job that exists already (idempotent retry).
    new: bool


async def submit(ctx: ApiContext, tenant: Tenant, job: JobRequest, *, client_id: bool,
                 names: FieldNames = FieldNames()) -> Submitted:
    """Queue `job` for `tenant`, or find the job a resubmitted `client_id` names.
    Raises the admission refusals, `QueueUnavailable` and `Conflict`."""
    started = time.perf_counter()
    existing = await anyio.to_thread.run_sync(_admit, ctx, tenant, job, client_id, names)
    if existing is not None:
        # Idempotent resubmission: same id, same tenant -> the existing job, no new run.
        if existing.tenant != tenant.name:
            raise _taken(job.job_id)
        return Submitted(job.job_id, existing.status, new=False)
    await anyio.to_thread.run_sync(ctx.publisher.publish, job)
    created, _, owner = await anyio.to_thread.run_sync(ctx.store.create, job)
    if not created and owner != tenant.name:  # another tenant's job took the id meanwhile
        raise _taken(job.job_id)
    # (Not created, same tenant: the scheduler read it first and recorded it.)
    SUBMITTED.labels(job.priority.value).inc()
    LATENCY.labels("submit").observe(time.perf_counter() - started)
    return Submitted(job.job_id, JobState.QUEUED, new=True)


def _admit(ctx: ApiContext, tenant: Tenant, job: JobRequest, client_id: bool,
           names: FieldNames) -> Optional[JobResult]:
    """The existing job for a resubmitted id; else None once the admission checks
    passed (Redis calls: a worker thread). A resubmission is answered with the existing
    job before any check, so a retry never pays the quota twice."""
    if client_id:
        existing = ctx.store.get(job.job_id)
        if existing is not None:
            return existing
    ctx.gate.check(tenant, job, output_field=names.max_new_tokens)
    return None


def _taken(job_id: str) -> Conflict:
    return Conflict(f"job_id {job_id!r} is taken; choose another or leave job_id out", param="job_id")


def priority_of(header: Optional[str], body: Optional[Priority]) -> Priority:
    """The job's class: the `X-Priority` header wins over the body's choice."""
    if header is None:
        return body or Priority.NORMAL
    try:
        return Priority(header.strip().lower())
    except ValueError:
        raise BadRequest(f"X-Priority {header!r} is not one of high, normal, low") from None
