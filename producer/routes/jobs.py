"""The native jobs API: submit, poll (or long-poll), cancel.

    POST   /v1/jobs          202 {"job_id", "status", "url"}   (validated, on Kafka, acks=all)
    GET    /v1/jobs/{id}     200 JobResult          (?wait=SECONDS long-polls until terminal)
    DELETE /v1/jobs/{id}     200 JobResult, cancelled (409 once terminal)

Request bodies are decoded with msgspec against `contracts.SubmitRequest`, so the
OpenAPI schema and the validation come from the same Struct and an error names the
field: "Expected `int`, got `str` - at `$.max_new_tokens`". Before a job is queued,
`producer.admission.Gate` checks its class ceiling, the class's backlog, overload (for
bronze) and the tenant's quota, each with its own status (see that module).
"""

from __future__ import annotations

import time
from typing import Optional

import anyio
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Histogram

from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, SubmitRequest, decode_submit
from kvfleet.tenancy import Tenant
from producer.context import ApiContext, context
from producer.errors import BadRequest, Conflict, NotFound
from producer.validation import build_request

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])
LATENCY = Histogram("kvfleet_api_request_duration_seconds", "HTTP handling time", ["route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

_SUBMIT_SCHEMA = msgspec.json.schema(SubmitRequest)
_RESULT_SCHEMA = msgspec.json.schema(JobResult)

router = APIRouter()


@router.post(
    "/v1/jobs", status_code=202,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _SUBMIT_SCHEMA}}}},
    responses={202: {"description": "Accepted: the job is on Kafka"},
               200: {"description": "A job with this job_id exists already (idempotent resubmission)"},
               401: {"description": "Missing or unknown API key"}, 403: {"description": "Unknown tenant"},
               409: {"description": "job_id taken by another tenant"},
               413: {"description": "Larger than the tenant's whole quota bucket"},
               422: {"description": "Invalid input or over the class's token ceiling; `error` says what to fix"},
               429: {"description": "Over quota, or the class's backlog is over its bound; see Retry-After"},
               503: {"description": "Kafka unavailable, or a bronze tenant while overloaded; nothing was queued"}},
)
async def submit(request: Request) -> Response:
    started = time.perf_counter()
    ctx = context(request)
    try:
        body = decode_submit(await request.body())
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid job: {exc}") from None
    tenant = ctx.tenant(request.headers, body.tenant)
    priority = _priority(request.headers.get("x-priority"), body.priority)
    job = build_request(body, ctx.model, tenant=tenant.name, priority=priority, now=time.time(),
                        default_timeout_s=ctx.settings.api.default_timeout_s)
    existing = await anyio.to_thread.run_sync(_admit, ctx, tenant, job, body.job_id is not None)
    if existing is None:
        # Kafka first, then the state (producer/publisher.py says why): a failed
        # produce records nothing, so a retry under the same job_id runs it once.
        await anyio.to_thread.run_sync(ctx.publisher.publish, job)
        created, _, owner = await anyio.to_thread.run_sync(ctx.store.create, job)
        if not created and owner != tenant.name:  # another tenant's job took the id meanwhile
            raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out")
        # (Not created, same tenant: the scheduler read it first and recorded it.)
        SUBMITTED.labels(priority.value).inc()
        LATENCY.labels("submit").observe(time.perf_counter() - started)
        return JSONResponse(_accepted(ctx, job.job_id, "queued"), status_code=202,
                            headers={"Location": f"/v1/jobs/{job.job_id}"})
    # Idempotent resubmission: same id, same tenant -> the existing job, no new run.
    if existing.tenant != tenant.name:
        raise Conflict(f"job_id {job.job_id!r} is taken; choose another or leave job_id out")
    return JSONResponse(_accepted(ctx, job.job_id, existing.status.value), status_code=200)


def _admit(ctx: ApiContext, tenant: Tenant, job: JobRequest, client_id: bool) -> Optional[JobResult]:
    """The existing job for a resubmitted id; else None once the admission checks
    passed (Redis calls: a worker thread). A resubmission is answered with the existing
    job before any check, so a retry never pays the quota twice."""
    if client_id:
        existing = ctx.store.get(job.job_id)
        if existing is not None:
            return existing
    ctx.gate.check(tenant, job)
    return None


@router.get(
    "/v1/jobs/{job_id}",
    responses={200: {"description": "The job's state and, once terminal, its result",
                     "content": {"application/json": {"schema": _RESULT_SCHEMA}}},
               404: {"description": "No such job for this tenant"}},
)
async def get_job(job_id: str, request: Request, wait: float = 0.0) -> Response:
    ctx = context(request)
    tenant = ctx.tenant(request.headers).name
    if wait < 0:
        raise BadRequest("`wait` must be >= 0 seconds")
    # Ownership first, then the wait: otherwise how long a 404 takes would tell another
    # tenant whether the job exists and when it ends.
    result = _owned(await ctx.read(job_id), job_id, tenant)
    if not result.status.terminal and wait > 0:
        result = _owned(await ctx.wait_terminal(job_id, min(wait, ctx.settings.api.max_wait_s)), job_id, tenant)
    return Response(msgspec.json.encode(result), media_type="application/json")


@router.delete(
    "/v1/jobs/{job_id}",
    responses={200: {"description": "Cancelled: its tokens are released; a running job stops at its next step",
                     "content": {"application/json": {"schema": _RESULT_SCHEMA}}},
               404: {"description": "No such job for this tenant"},
               409: {"description": "The job already ended (done, failed, expired, rejected or cancelled)"}},
)
async def cancel_job(job_id: str, request: Request) -> Response:
    ctx = context(request)
    tenant = ctx.tenant(request.headers).name
    result = _owned(await ctx.read(job_id), job_id, tenant)
    if not result.status.terminal:
        # One Lua call: cancelled + its reservation released, unless it ended meanwhile.
        moved = await anyio.to_thread.run_sync(lambda: ctx.store.fail(
            job_id, JobState.CANCELLED, "cancelled", "cancelled by the client", now=time.time()))
        result = await ctx.read(job_id)
        if moved.ok and result is not None:
            return Response(msgspec.json.encode(result), media_type="application/json")
    state = result.status.value if result is not None else "gone"
    raise Conflict(f"job {job_id!r} already ended ({state}); nothing to cancel")


def _owned(result: Optional[JobResult], job_id: str, tenant: str) -> JobResult:
    # Another tenant's job answers exactly like a missing one: ids are not secrets,
    # but their existence should not leak either.
    if result is None or result.tenant != tenant:
        raise NotFound(f"no job {job_id!r} for tenant {tenant!r}")
    return result


def _priority(header: Optional[str], body: Optional[Priority]) -> Priority:
    if header is None:
        return body or Priority.NORMAL
    try:
        return Priority(header.strip().lower())
    except ValueError:
        raise BadRequest(f"X-Priority {header!r} is not one of high, normal, low") from None


def _accepted(ctx: ApiContext, job_id: str, status: str) -> dict:
    return {"job_id": job_id, "status": status, "url": f"{ctx.settings.api.base_url}/v1/jobs/{job_id}"}
