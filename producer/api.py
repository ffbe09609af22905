"""The HTTP API: submit jobs, poll (or long-poll) their results, health and metrics.

    POST   /v1/jobs          202 {"job_id", "status", "url"}   (validated, on Kafka, acks=all)
    GET    /v1/jobs/{id}     200 JobResult          (?wait=SECONDS long-polls until terminal)
    DELETE /v1/jobs/{id}     200 JobResult, cancelled (409 once terminal)
    GET  /healthz            the process is up
    GET  /readyz             Kafka and Redis answer
    GET  /metrics            Prometheus

Request bodies are decoded with msgspec against `contracts.SubmitRequest`, so the
OpenAPI schema and the validation come from the same Struct and an error names the
field: "Expected `int`, got `str` - at `$.max_new_tokens`". Before a job is queued,
`producer.admission.Gate` checks its class ceiling, the class's backlog, overload (for
bronze) and the tenant's quota, each with its own status (see that module).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Optional

import anyio
import msgspec
import redis
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from kvfleet import logs
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, SubmitRequest, decode_submit
from kvfleet.jobstore import JobStore, result_from_hash
from kvfleet.kafka import ensure_topics
from kvfleet.settings import Settings
from producer.admission import Gate, Refused
from producer.auth import AuthError, resolve_tenant
from producer.pressure import Pressure
from producer.publisher import EnqueueError, Publisher
from producer.validation import BadRequest, ModelLimits, build_request, load_limits
from scheduler.capacity import FleetCapacity
from scheduler.config import Tenancy
from scheduler.ledger import Ledger
from scheduler.quota import Quotas
from scheduler.tenants import Tenant

log = logging.getLogger("kvfleet.api")

SUBMITTED = Counter("kvfleet_api_jobs_submitted", "Jobs accepted onto Kafka", ["priority"])
REFUSED = Counter("kvfleet_api_jobs_refused", "Submissions refused, by HTTP status", ["status"])
LATENCY = Histogram("kvfleet_api_request_duration_seconds", "HTTP handling time", ["route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

_SUBMIT_SCHEMA = msgspec.json.schema(SubmitRequest)
_RESULT_SCHEMA = msgspec.json.schema(JobResult)


def _error(status: int, message: str, headers: Optional[dict[str, str]] = None, **extra) -> JSONResponse:
    REFUSED.labels(str(status)).inc()
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def create_app(settings: Settings, *, limits: Optional[ModelLimits] = None, tenancy: Optional[Tenancy] = None,
               ) -> FastAPI:
    keys = settings.redis.keys
    sync_redis = redis.Redis.from_url(settings.redis.url)
    store = JobStore(sync_redis, keys)
    publisher = Publisher(settings.kafka, store)
    async_redis = aredis.Redis.from_url(settings.redis.url)
    model = limits or load_limits(settings.model.source)
    tenancy = tenancy or Tenancy.from_env(os.environ, settings.api.api_keys)
    capacity = FleetCapacity(sync_redis, keys, ceiling_tokens=settings.scheduler.capacity_ceiling_tokens or None)
    pressure = Pressure(settings.kafka, Ledger(sync_redis, keys), capacity)
    quotas = Quotas(sync_redis, keys, tenancy.directory) if tenancy.directory is not None else None
    gate = Gate(settings.api, settings.policy, pressure, quotas)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await anyio.to_thread.run_sync(ensure_topics, settings.kafka)
        pressure.start()
        log.info("api ready", extra={"model": model.name, "max_context": model.max_context})
        yield
        await anyio.to_thread.run_sync(pressure.stop)
        await anyio.to_thread.run_sync(publisher.close)
        await async_redis.aclose()
        sync_redis.close()

    app = FastAPI(title="kvfleet", version="1", lifespan=lifespan,
                  description="Asynchronous LLM inference: submit a job, then poll its result by id.")

    @app.post(
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
        try:
            body = decode_submit(await request.body())
        except msgspec.DecodeError as exc:
            return _error(422, f"invalid job: {exc}")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            tenant = resolve_tenant(tenancy, headers, body.tenant, default_tenant=settings.api.default_tenant)
            priority = _priority(headers.get("x-priority"), body.priority)
            job, prompt_len = build_request(body, model, tenant=tenant.name, priority=priority, now=time.time(),
                                            default_timeout_s=settings.api.default_timeout_s)
            created, state, owner = await anyio.to_thread.run_sync(_record, tenant, job, prompt_len,
                                                                   body.job_id is not None)
        except AuthError as exc:
            return _error(exc.status, exc.message)
        except BadRequest as exc:
            return _error(422, str(exc))
        except Refused as exc:
            return _error(exc.status, exc.message, exc.headers)
        if not created:
            # Idempotent resubmission: same id, same tenant -> the existing job, no new run.
            if owner != tenant.name:
                return _error(409, f"job_id {job.job_id!r} is taken; choose another or leave job_id out")
            return JSONResponse(_accepted(settings, job.job_id, state.value), status_code=200)
        try:
            await anyio.to_thread.run_sync(publisher.publish, job)
        except EnqueueError as exc:
            return _error(503, f"the queue is unavailable ({exc}); nothing will run, retry later",
                          job_id=job.job_id)
        SUBMITTED.labels(priority.value).inc()
        LATENCY.labels("submit").observe(time.perf_counter() - started)
        return JSONResponse(_accepted(settings, job.job_id, "queued"), status_code=202,
                            headers={"Location": f"/v1/jobs/{job.job_id}"})

    def _record(tenant: Tenant, job: JobRequest, prompt_len: int, client_id: bool) -> tuple[bool, JobState, str]:
        """Admission checks, then the job recorded as queued (Redis calls: a worker thread)."""
        if client_id:
            # A resubmission (a client retrying with its own id) is answered with the
            # existing job before any check, so a retry never pays the quota twice.
            existing = store.get(job.job_id)
            if existing is not None:
                return False, existing.status, existing.tenant
        gate.check(tenant, job, prompt_len)
        return store.create(job)

    @app.get(
        "/v1/jobs/{job_id}",
        responses={200: {"description": "The job's state and, once terminal, its result",
                         "content": {"application/json": {"schema": _RESULT_SCHEMA}}},
                   404: {"description": "No such job for this tenant"}},
    )
    async def get_job(job_id: str, request: Request, wait: float = 0.0) -> Response:
        try:
            tenant = _tenant_of(request)
        except AuthError as exc:
            return _error(exc.status, exc.message)
        if wait < 0:
            return _error(422, "`wait` must be >= 0 seconds")
        wait = min(wait, settings.api.max_wait_s)
        result = await _read(job_id)
        if result is not None and not result.status.terminal and wait > 0:
            result = await _wait_terminal(job_id, wait)
        # Another tenant's job answers exactly like a missing one: ids are not secrets,
        # but their existence should not leak either.
        if result is None or result.tenant != tenant:
            return _error(404, f"no job {job_id!r} for tenant {tenant!r}")
        return Response(msgspec.json.encode(result), media_type="application/json")

    @app.delete(
        "/v1/jobs/{job_id}",
        responses={200: {"description": "Cancelled: its tokens are released; a running job stops at its next step",
                         "content": {"application/json": {"schema": _RESULT_SCHEMA}}},
                   404: {"description": "No such job for this tenant"},
                   409: {"description": "The job already ended (done, failed, expired, rejected or cancelled)"}},
    )
    async def cancel_job(job_id: str, request: Request) -> Response:
        try:
            tenant = _tenant_of(request)
        except AuthError as exc:
            return _error(exc.status, exc.message)
        result = await _read(job_id)
        if result is None or result.tenant != tenant:
            return _error(404, f"no job {job_id!r} for tenant {tenant!r}")
        if not result.status.terminal:
            # One Lua call: cancelled + its reservation released, unless it ended meanwhile.
            moved = await anyio.to_thread.run_sync(lambda: store.fail(
                job_id, JobState.CANCELLED, "cancelled", "cancelled by the client", now=time.time()))
            result = await _read(job_id)
            if moved.ok and result is not None:
                return Response(msgspec.json.encode(result), media_type="application/json")
        state = result.status.value if result is not None else "gone"
        return _error(409, f"job {job_id!r} already ended ({state}); nothing to cancel")

    def _tenant_of(request: Request) -> str:
        headers = {k.lower(): v for k, v in request.headers.items()}
        return resolve_tenant(tenancy, headers, default_tenant=settings.api.default_tenant).name

    async def _read(job_id: str) -> Optional[JobResult]:
        return result_from_hash(job_id, await async_redis.hgetall(keys.job(job_id)))

    async def _wait_terminal(job_id: str, timeout: float) -> Optional[JobResult]:
        pubsub = async_redis.pubsub()
        await pubsub.subscribe(keys.job_events(job_id))
        try:
            deadline = time.monotonic() + timeout
            while True:
                # Read after subscribing: a change between our first read and the
                # subscription would otherwise be missed until the timeout.
                result = await _read(job_id)
                remaining = deadline - time.monotonic()
                if result is None or result.status.terminal or remaining <= 0:
                    return result
                # Capped at 1 s so a lost notification costs at most a second.
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))
        finally:
            await pubsub.unsubscribe()
            await pubsub.aclose()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        checks = {"redis": False, "kafka": False}
        try:
            checks["redis"] = bool(await asyncio.wait_for(async_redis.ping(), 2.0))
        except (redis.RedisError, OSError, asyncio.TimeoutError):
            pass
        checks["kafka"] = await anyio.to_thread.run_sync(publisher.ready)
        ok = all(checks.values())
        return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _priority(header: Optional[str], body: Optional[Priority]) -> Priority:
    if header is None:
        return body or Priority.NORMAL
    try:
        return Priority(header.strip().lower())
    except ValueError:
        raise BadRequest(f"X-Priority {header!r} is not one of high, normal, low") from None


def _accepted(settings: Settings, job_id: str, status: str) -> dict:
    return {"job_id": job_id, "status": status, "url": f"{settings.api.base_url}/v1/jobs/{job_id}"}


def main() -> None:
    settings = Settings.from_env()
    logs.setup("api", settings.log_level)
    uvicorn.run(create_app(settings), host=settings.api.host, port=settings.api.port,
                log_config=None, access_log=False)


if __name__ == "__main__":
    main()
