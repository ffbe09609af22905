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
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Histogram

from kvfleet.contracts import JobResult, JobState, Priority, SubmitRequest, decode_submit
from producer import openapi
from producer.answers import Accepted
from producer.context import ApiContext, context
from producer.errors import BadRequest, Conflict, NotFound
from producer.submission import PARSE, submit as submit_job
from producer.validation import build_request_off_loop

LATENCY = Histogram("kvfleet_api_request_duration_seconds", "HTTP handling time", ["route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

# `build_request` refuses neither or both; msgspec's schema cannot say so itself.
openapi.exactly_one(SubmitRequest, "prompt", "prompt_tokens")

router = APIRouter()


@router.post(
    "/v1/jobs", status_code=202,
    openapi_extra=openapi.body(SubmitRequest),
    responses={202: openapi.response(Accepted, "Accepted: the job is on Kafka"),
               200: openapi.response(Accepted, "A job with this job_id exists already (idempotent resubmission)"),
               401: openapi.error_response("Missing or unknown API key"),
               403: openapi.error_response("Unknown tenant, or the API key is another tenant's"),
               409: openapi.error_response("job_id taken by another tenant"),
               413: openapi.error_response("Larger than the tenant's whole quota bucket"),
               422: openapi.error_response("Invalid input or over the class's token ceiling; `error` says what to fix"),
               429: openapi.error_response("Over quota, or the class's backlog is over its bound; see Retry-After"),
               503: openapi.error_response("Kafka unavailable, or a bronze tenant while overloaded; nothing was queued")},
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
    job = await build_request_off_loop(body, ctx.model, tenant=tenant.name, priority=priority, now=time.time(),
                                       default_timeout_s=ctx.settings.api.default_timeout_s)
    PARSE.observe(time.perf_counter() - started)
    existing = await submit_job(ctx, tenant, job, client_id=body.job_id is not None)
    if existing is None:
        LATENCY.labels("submit").observe(time.perf_counter() - started)
        return JSONResponse(_accepted(ctx, job.job_id, "queued"), status_code=202,
                            headers={"Location": f"/v1/jobs/{job.job_id}"})
    # Idempotent resubmission: same id, same tenant -> the existing job, no new run.
    return JSONResponse(_accepted(ctx, job.job_id, existing.status.value), status_code=200)


@router.get(
    "/v1/jobs/{job_id}",
    responses={200: openapi.response(JobResult, "The job's state and, once terminal, its result"),
               401: openapi.error_response("Missing or unknown API key"),
               403: openapi.error_response("Unknown tenant, or the API key is another tenant's"),
               404: openapi.error_response("No such job for this tenant"),
               422: openapi.error_response("`wait` is not a number of seconds >= 0")},
)
async def get_job(job_id: str, request: Request,
                  wait: float = Query(0.0, ge=0, allow_inf_nan=False,
                                      description="Seconds to long-poll until the job is terminal "
                                                  "(capped by the server's max_wait_s); 0 answers at once"),
                  ) -> Response:
    # A negative `wait` is refused by FastAPI (Query(ge=0)), as an ApiError (see create_app).
    ctx = context(request)
    tenant = ctx.tenant(request.headers).name
    # Ownership first, then the wait: otherwise how long a 404 takes would tell another
    # tenant whether the job exists and when it ends.
    result = _owned(await ctx.read(job_id), job_id, tenant)
    if not result.status.terminal and wait > 0:
        result = _owned(await ctx.wait_terminal(job_id, min(wait, ctx.settings.api.max_wait_s)), job_id, tenant)
    return Response(msgspec.json.encode(result), media_type="application/json")


@router.delete(
    "/v1/jobs/{job_id}",
    responses={200: openapi.response(JobResult, "Cancelled: its tokens are released; a running job stops at "
                                                "its next step"),
               401: openapi.error_response("Missing or unknown API key"),
               403: openapi.error_response("Unknown tenant, or the API key is another tenant's"),
               404: openapi.error_response("No such job for this tenant"),
               409: openapi.error_response("The job already ended (done, failed, expired, rejected or cancelled)")},
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
